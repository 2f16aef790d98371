#!/usr/bin/env python
"""One prepared check for a lent GPU machine: greedy identity, forward-cost curves and per-round overhead.

Everything is built on the spot (no downloads, no real weights) and the run prints one table:

- ``a`` greedy identity: tiny Llama and Qwen2 targets (``testkit/tiny_models.py``) with an identical and a random
  drafter, in float32 and bfloat16. Each runs as a real cluster (``runtime.launchers.cluster``, both nodes on
  ``--device``) and is compared token by token with transformers ``generate(do_sample=False)`` of the target alone on
  the same device and dtype. float32 must match everywhere (else the exit code is 1); bfloat16 is reported only,
  since a batched verification forward and one-token forwards may round differently.
- ``b`` cost curves: random-weight models with the shapes of Qwen2.5-1.5B and Qwen2.5-0.5B, bf16: median time of
  one cached forward of n = 1, 2, 4, 8, 16 new tokens after a 200-token prefix (``shared.kv.CachedLM``, synchronised).
  ``shared.costs.measure.measure_curve`` is used when the tree has it (its column is then shown beside this script's
  own).
- ``c`` per-round overhead: the same random pair as a cluster with ``configs/gpu.yaml``'s settings (model folders
  and device replaced), one greedy generation of 64 tokens, against transformers on the target alone and
  transformers assisted generation on the same device. Random weights mean near-zero acceptance: this part
  measures the cost of a round, not a speed-up.
- ``d`` compiled step (on a GPU, or with ``--compiled``): ``backend: compiled`` (``shared.backend.CompiledBackend``,
  CUDA graphs through ``mode="reduce-overhead"`` on a GPU, buckets 1, 2, 4, 8): greedy speculative rounds with drafts
  of 0 to 7 tokens (half of them wrong) on tiny float32 Llama and Qwen2 targets must equal ``generate`` (else exit
  1), with the compile time per bucket; then ms per single-token decode step of the smaller random model of ``b``
  (bf16, after the same prefix) on a dynamic cache, eager static slots and the compiled step.

A time guard skips what is left, with a note, once ``--budget`` seconds have passed (checked before every step).

On the GPU machine pyzmq is missing and transformers is too old (the lent H200s have 5.17, which ignores the
forward's ``cache=`` argument that ``shared.kv.CachedLM`` passes); torch, msgpack and pyyaml are there. Carry
wheels (~15 MB; ``wheels/`` is git-ignored, so name it in the run's carry list)::

    # here: wheels for the GPU machine's Python (3.12 on the lent H200s); transformers = the version tested here
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \\
        -d wheels pyzmq msgpack transformers==5.24.0
    # there
    PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py --install-wheels wheels --out $OUT

The first row (``pre``) checks that the cached forward gives a full forward's logits; if it does not, the run stops
there (exit 1) with that advice.

``--device cpu --quick`` runs everything with tiny models and half the identity clusters (a CPU smoke); ``--smoke``
is smaller still (the test).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import gc
import importlib
import importlib.metadata
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
GPU_CONFIG = REPO_ROOT / "configs" / "gpu.yaml"
DEFAULT_BUDGET_S = 270.0

#: import name -> the distribution to carry as a wheel when it is missing
REQUIRED = {"torch": "torch", "transformers": "transformers", "tokenizers": "tokenizers",
            "safetensors": "safetensors", "yaml": "pyyaml", "zmq": "pyzmq", "msgpack": "msgpack"}

QWEN_1_5B = {"hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
             "intermediate_size": 8960, "vocab_size": 151936}
QWEN_0_5B = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
             "intermediate_size": 4864, "vocab_size": 151936}
TINY_TARGET = {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
               "intermediate_size": 256, "vocab_size": 1024}
TINY_DRAFT = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128, "vocab_size": 1024}

IDENTITY_PROMPTS = [[5, 17, 33, 2, 60], [100, 101, 7], [42] * 12 + [9, 8]]
WARMUP_TOKENS = 8


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one mode runs."""

    archs: tuple[str, ...] = ("llama", "qwen2")
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    prompts: int = 3
    identity_tokens: int = 32
    target_shape: dict = dataclasses.field(default_factory=lambda: QWEN_1_5B)
    draft_shape: dict = dataclasses.field(default_factory=lambda: QWEN_0_5B)
    shape_names: tuple[str, str] = ("Qwen2.5-1.5B", "Qwen2.5-0.5B")
    sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    prefix_len: int = 200
    reps: int = 5
    overhead_tokens: int = 64
    overhead_prompt_len: int = 100
    #: every arch × dtype with both drafters; else each arch × dtype once, the drafters alternating (half the
    #: cluster starts, which dominate on a small CPU machine, and each arch and each dtype still sees both)
    full_matrix: bool = True
    drafter_kinds: tuple[str, ...] = ("identical", "random")

    def drafters(self, arch_index: int, dtype_index: int) -> tuple[str, ...]:
        if self.full_matrix:
            return self.drafter_kinds
        return (self.drafter_kinds[(arch_index + dtype_index) % len(self.drafter_kinds)],)


PLANS = {
    "full": Plan(),
    "quick": Plan(target_shape=TINY_TARGET, draft_shape=TINY_DRAFT, shape_names=("tiny target", "tiny drafter"),
                  full_matrix=False),
    # one identity cluster (the random drafter: rejections and rollbacks) and one overhead cluster
    "smoke": Plan(archs=("llama",), dtypes=("float32",), drafter_kinds=("random",), prompts=2, identity_tokens=16,
                  target_shape=TINY_TARGET,
                  draft_shape=TINY_DRAFT, shape_names=("tiny target", "tiny drafter"), sizes=(1, 4), prefix_len=50,
                  reps=3, overhead_tokens=16, overhead_prompt_len=20),
}


class Guard:
    """The time budget: ``over(what)`` is true once it is spent, and remembers what was skipped."""

    def __init__(self, budget_s: float):
        self.start = time.monotonic()
        self.budget_s = budget_s
        self.skipped: list[str] = []

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def over(self, what: str) -> bool:
        if self.elapsed() <= self.budget_s:
            return False
        self.skipped.append(what)
        return True


class Report:
    """The one table (rows of part, item, result, detail) and the raw numbers behind it."""

    def __init__(self) -> None:
        self.rows: list[dict[str, str]] = []
        self.raw: dict[str, Any] = {}
        self.failed: list[str] = []

    def row(self, part: str, item: str, result: str, detail: str = "") -> None:
        self.rows.append({"part": part, "item": item, "result": result, "detail": detail})
        print(f"[gpu_check] {part} | {item} | {result} | {detail}", file=sys.stderr, flush=True)

    def skip(self, part: str, item: str, guard: Guard) -> None:
        self.row(part, item, "skipped", f"over the time budget ({guard.budget_s:.0f} s; {guard.elapsed():.0f} s gone)")

    def error(self, part: str, item: str, exc: BaseException) -> None:
        text = f"{type(exc).__name__}: {exc}"
        self.failed.append(f"{part} {item}: {text}")
        self.row(part, item, "ERROR", text.splitlines()[0][:200])
        self.raw.setdefault("errors", []).append({"part": part, "item": item, "error": text,
                                                  "traceback": traceback.format_exc()})


def log(message: str) -> None:
    print(f"[gpu_check] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ environment


def install_wheels(folder: Path, target: Path) -> None:
    """``pip install --no-index`` every wheel in ``folder`` into ``target`` and put it on the path of this process
    and of the node processes it starts (``PYTHONPATH``)."""
    wheels = sorted(str(p) for p in folder.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"gpu_check: --install-wheels {folder}: no .whl files there")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--upgrade", "--target", str(target), *wheels]
    log(f"installing {len(wheels)} wheel(s) from {folder} into {target}")
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SystemExit(f"gpu_check: pip install of the wheels in {folder} failed (exit {proc.returncode}); "
                         "were they downloaded for this machine's Python version and platform?")
    sys.path.insert(0, str(target))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))
    importlib.invalidate_caches()


def missing_imports() -> list[str]:
    missing = []
    for module, dist in REQUIRED.items():
        try:
            importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"{module} (pip package {dist}: {exc})")
    return missing


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in ("torch", "transformers", "tokenizers", "pyzmq", "msgpack"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        return f"{props.name}, {props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}"
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def load_tiny_models():
    """:mod:`testkit.tiny_models`, the builders the tests use (imported late: the repo root goes on the path in
    :func:`main` first)."""
    return importlib.import_module("testkit.tiny_models")


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def free_memory(device: str) -> None:
    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def load_on(folder: Path, device: str, dtype: str):
    from transformers import AutoModelForCausalLM

    from shared.models import DTYPES

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=DTYPES[dtype]).to(device).eval()


def hf_generate(model, prompt: list[int], max_new_tokens: int, device: str, assistant=None) -> list[int]:
    """transformers greedy ``generate`` with no end token (every run makes exactly ``max_new_tokens``)."""
    import copy

    import torch

    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = []  # not None: None would fall back to the checkpoint's own EOS
    config.pad_token_id = 1
    config.do_sample = False
    config.max_new_tokens = max_new_tokens
    config.min_new_tokens = max_new_tokens
    ids = torch.tensor([prompt], device=device)
    extra = {"assistant_model": assistant} if assistant is not None else {}
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, **extra)
    return out[0, len(prompt):].tolist()


def preflight(device: str, tm, report: Report) -> bool:
    """Does ``CachedLM`` (the forward's ``cache=`` argument, transformers ≥ 5.2x) give a full forward's logits? An
    older transformers ignores the argument and forgets the prefix: then nothing after this is meaningful."""
    import torch
    from transformers import AutoModelForCausalLM

    from shared.kv import CachedLM

    ids = [5, 17, 33, 2, 60, 9, 8]
    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tm.model_config("llama", 160), dtype=torch.float32).to(device).eval()
        lm = CachedLM(model)
        lm.feed(ids[:-2])
        cached = lm.feed(ids[-2:])[0]
        with torch.inference_mode():
            full = model(input_ids=torch.tensor([ids], device=device)).logits[0, -2:].float()
        err = float((cached - full).abs().max())
        ok, detail = err < 1e-3, f"largest logit difference {err:.2e} (tiny llama, float32)"
    except Exception as exc:
        ok, detail = False, f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    if not ok:
        detail += (f"; transformers {importlib.metadata.version('transformers')} does not take the forward's cache= "
                   "argument: carry a newer transformers wheel (the version this tree is tested with) and rerun")
        report.failed.append("preflight: the cached forward differs from a full forward")
    report.row("pre", "cached forward = full forward", "ok" if ok else "FAIL", detail)
    return ok


# ---------------------------------------------------------------------------------------------- a: identity


def identity_config(target: Path, drafter: Path, device: str, dtype: str) -> dict[str, Any]:
    return {
        "verifier": {"model": str(target), "device": device, "dtype": dtype, "threads": 1, "draft_timeout_ms": 3000},
        "drafter": {"model": str(drafter), "device": device, "dtype": dtype, "threads": 1, "num_draft_tokens": 4,
                    "draft_schedule": "constant"},
        "client": {"timeout_s": 120},
        "launch": {"ready_timeout_s": 180},
    }


async def run_generations(config: dict[str, Any], requests: list[dict[str, Any]]) -> list[Any]:
    """Start a real cluster for ``config`` and run ``requests`` one after another; a failure carries the node logs."""
    from runtime.launch import cluster

    async with cluster(config) as client:
        try:
            return [await client.generate(**request) for request in requests]
        except Exception as exc:
            tails = "\n".join(f"--- end of {role} log ---\n{client.cluster.log_tail(role)}"
                              for role in client.cluster.nodes())
            raise RuntimeError(f"{type(exc).__name__}: {exc}\n{tails}") from exc


def part_identity(plan: Plan, device: str, tmp: Path, tm, guard: Guard, report: Report, parallel: int) -> None:
    root = tmp / "identity"
    tokenizer = root / "tokenizer"
    tm.build_tokenizer(tokenizer)
    prompts = IDENTITY_PROMPTS[: plan.prompts]
    n = plan.identity_tokens
    cases = []
    for i, arch in enumerate(plan.archs):
        target = tm.build_model(root / f"{arch}-target", arch, tokenizer, seed=1, layers=2)
        folders = {"identical": target, "random": tm.build_model(root / f"{arch}-random", arch, tokenizer, seed=2,
                                                                 layers=1)}
        for j, dtype in enumerate(plan.dtypes):
            if guard.over(f"a {arch} {dtype}"):
                report.skip("a", f"{arch} {dtype}", guard)
                continue
            model = load_on(target, device, dtype)
            expected = [hf_generate(model, p, n, device) for p in prompts]
            del model
            for name in plan.drafters(i, j):
                cases.append({"arch": arch, "dtype": dtype, "drafter": name, "target": target,
                              "drafter_dir": folders[name], "expected": expected})
    free_memory(device)

    async def one(case: dict[str, Any], gate: asyncio.Semaphore) -> dict[str, Any] | None:
        async with gate:
            label = f"{case['arch']} · {case['drafter']} drafter · {case['dtype']}"
            if guard.over(f"a {label}"):
                report.skip("a", label, guard)
                return None
            config = identity_config(case["target"], case["drafter_dir"], device, case["dtype"])
            requests = [{"token_ids": p, "max_new_tokens": n, "do_sample": False, "eos_token_ids": []} for p in prompts]
            t0 = time.monotonic()
            try:
                results = await run_generations(config, requests)
            except Exception as exc:
                report.error("a", label, exc)
                return None
            got = [r.token_ids for r in results]
            matches = sum(g == e for g, e in zip(got, case["expected"]))
            drafted = sum(r.metrics["draft_tokens"] for r in results)
            accepted = sum(r.metrics["accepted_tokens"] for r in results)
            first_diff = [next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), min(len(g), len(e)))
                          for g, e in zip(got, case["expected"]) if g != e]
            detail = f"acceptance {accepted / drafted if drafted else 0:.2f}, {time.monotonic() - t0:.1f} s"
            if first_diff:
                detail += f"; first differing token at {first_diff}"
            report.row("a", label, f"{matches}/{len(prompts)} prompts match", detail)
            return {"arch": case["arch"], "dtype": case["dtype"], "drafter": case["drafter"], "matches": matches,
                    "prompts": len(prompts), "tokens": n, "acceptance": accepted / drafted if drafted else 0.0,
                    "got": got, "expected": case["expected"]}

    async def run_all() -> list[dict[str, Any] | None]:
        gate = asyncio.Semaphore(parallel)
        return await asyncio.gather(*(one(case, gate) for case in cases))

    done = [r for r in asyncio.run(run_all()) if r is not None]
    report.raw["identity"] = done
    for dtype in plan.dtypes:
        rows = [r for r in done if r["dtype"] == dtype]
        if not rows:
            continue
        matched, total = sum(r["matches"] for r in rows), sum(r["prompts"] for r in rows)
        report.row("a", f"{dtype}: all cases", f"{matched}/{total} prompts match",
                   f"{len(rows)} cluster(s) × {len(prompts)} prompts × {n} tokens vs transformers generate")
        if dtype == "float32" and matched != total:
            report.failed.append(f"float32 greedy identity: {matched}/{total}")


# ---------------------------------------------------------------------------------------------- b: costs


def build_shaped(shape: dict, seed: int, device: str, tokenizer, folder: Path, tm):
    """A random Qwen2 model of ``shape`` in bf16, made on ``device`` (fast: no CPU init of 1.5 B weights), with
    the fresh LM head of ``tiny_models.save_tiny``, saved with ``tokenizer`` into ``folder``."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**shape, max_position_embeddings=4096, eos_token_id=0, pad_token_id=1, bos_token_id=None,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tm.save_tiny(model, tokenizer, folder)
    return model.eval()


def own_curve(model, sizes: tuple[int, ...], prefix_len: int, reps: int, device: str) -> list[float]:
    """Median seconds of one cached forward of n new tokens after ``prefix_len`` cached tokens, per n."""
    import torch

    from shared.kv import CachedLM

    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(2, vocab, (prefix_len,), generator=g).tolist()
    lm = CachedLM(model)
    lm.feed(prefix)
    out = []
    for n in sizes:
        step = prefix[-n:]
        times = []
        for rep in range(reps + 2):  # two untimed warm-ups per size
            sync(device)
            t0 = time.perf_counter()
            lm.feed(step)
            sync(device)
            if rep >= 2:
                times.append(time.perf_counter() - t0)
            lm.crop(prefix_len)
        out.append(statistics.median(times))
    return out


def shared_costs_curve(model, sizes: tuple[int, ...], prefix_len: int, budget_s: float) -> list[float] | None:
    """``shared.costs.measure.measure_curve`` when the tree has it (another part of the project), else None."""
    try:
        import shared.costs.measure
    except ImportError:
        return None
    if not Path(shared.costs.measure.__file__).resolve().is_relative_to(REPO_ROOT):
        return None  # an editable install's fallback to another checkout: not this tree's code
    measure_curve = shared.costs.measure.measure_curve
    curve = measure_curve(model, list(sizes), prefix_len, budget_s)
    by_size = dict(zip(list(curve.sizes), list(curve.seconds)))
    return [by_size.get(n) for n in sizes]


def _ms(values: list[float | None]) -> str:
    return " · ".join("—" if v is None else f"{1000 * v:.2f}" for v in values)


def part_costs(plan: Plan, device: str, models: list[tuple[str, Any]], guard: Guard, report: Report) -> None:
    sizes = plan.sizes
    raw = report.raw.setdefault("costs", {"sizes": list(sizes), "prefix_len": plan.prefix_len, "models": {}})
    for name, model in models:
        if guard.over(f"b {name}"):
            report.skip("b", name, guard)
            continue
        try:
            own = own_curve(model, sizes, plan.prefix_len, plan.reps, device)
        except Exception as exc:
            report.error("b", name, exc)
            continue
        try:
            shared = shared_costs_curve(model, sizes, plan.prefix_len, max(5.0, min(30.0, guard.left() / 4)))
        except Exception as exc:  # another engineer's module: report it, keep this script's own numbers
            report.error("b", f"{name} (shared.costs)", exc)
            shared = None
        raw["models"][name] = {"own_s": own, "shared_costs_s": shared}
        detail = f"n = {', '.join(map(str, sizes))}; median of {plan.reps}; T(n)/T(1): " + " · ".join(
            f"{t / own[0]:.2f}" for t in own)
        report.row("b", f"{name} bf16, ms per forward (own timer)", _ms(own), detail)
        if shared is not None:
            report.row("b", f"{name} bf16, ms per forward (shared.costs)", _ms(shared),
                       "measure_curve (its own repeats and budget; — = a size it skipped)")
    names = [name for name, _ in models]
    got = raw["models"]
    if len(names) == 2 and all(n in got for n in names):
        c = got[names[1]]["own_s"][0] / got[names[0]]["own_s"][0]
        raw["c"] = c
        report.row("b", "c = drafter step / target step (n = 1)", f"{c:.3f}", "the speed model's cost ratio")


# ---------------------------------------------------------------------------------------------- c: overhead


def overhead_config(target: Path, drafter: Path, device: str) -> dict[str, Any]:
    """``configs/gpu.yaml`` with the random model folders and ``device`` in place of the real models and cuda:0."""
    import yaml

    config = yaml.safe_load(GPU_CONFIG.read_text())
    config["verifier"].update(model=str(target), device=device)
    config["drafter"].update(model=str(drafter), device=device)
    if device == "cpu":  # the CPU smoke shares two cores
        config["verifier"]["threads"] = config["drafter"]["threads"] = 1
    config["client"] = {**config.get("client", {}), "timeout_s": 120}
    config["launch"] = {"ready_timeout_s": 180}
    return config


def part_overhead(plan: Plan, device: str, pair: tuple[Any, Any], folders: tuple[Path, Path], guard: Guard,
                  report: Report) -> None:
    import torch

    target, draft = pair
    n = plan.overhead_tokens
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(2, target.config.vocab_size, (plan.overhead_prompt_len,), generator=g).tolist()
    raw = report.raw.setdefault("overhead", {"new_tokens": n, "prompt_tokens": len(prompt)})
    reference = None
    for key, label, assistant in (("hf_target", "transformers generate, target alone", None),
                                  ("hf_assisted", "transformers assisted generation", draft)):
        if guard.over(f"c {label}"):
            report.skip("c", label, guard)
            continue
        try:
            hf_generate(target, prompt, WARMUP_TOKENS, device, assistant)
            sync(device)
            t0 = time.perf_counter()
            tokens = hf_generate(target, prompt, n, device, assistant)
            sync(device)
            elapsed = time.perf_counter() - t0
        except Exception as exc:
            report.error("c", label, exc)
            continue
        reference = reference or tokens
        raw[key] = {"tokens_per_second": len(tokens) / elapsed, "elapsed_s": elapsed, "token_ids": tokens}
        report.row("c", label, f"{len(tokens) / elapsed:.1f} tok/s", f"{len(tokens)} tokens in {elapsed:.2f} s")
    label = "pipespec (configs/gpu.yaml settings)"
    if guard.over(f"c {label}"):
        report.skip("c", label, guard)
        return
    config = overhead_config(folders[0], folders[1], device)
    requests = [{"token_ids": prompt, "max_new_tokens": m, "do_sample": False, "eos_token_ids": []}
                for m in (WARMUP_TOKENS, n)]
    try:
        t0 = time.monotonic()
        result = asyncio.run(run_generations(config, requests))[-1]
        wall = time.monotonic() - t0
    except Exception as exc:
        report.error("c", label, exc)
        return
    m = result.metrics
    keys = ("tokens_per_second", "message_overhead_ms_per_round", "draft_transit_ms", "rounds", "acceptance_rate",
            "mean_accepted_length", "verifier_busy_fraction", "drafter_busy_fraction", "elapsed_s")
    raw["pipespec"] = {k: m.get(k) for k in keys} | {"token_ids": result.token_ids, "cluster_wall_s": wall}
    same = "" if reference is None else (
        "; output = transformers'" if result.token_ids == reference else "; output differs from transformers' (bf16)")
    report.row("c", label, f"{m['tokens_per_second']:.1f} tok/s",
               f"rounds {m['rounds']}, message overhead {m['message_overhead_ms_per_round']:.2f} ms/round, "
               f"draft transit {m['draft_transit_ms']:.2f} ms, acceptance {m['acceptance_rate']:.2f}{same}")


def part_models(plan: Plan, device: str, tmp: Path, tm, guard: Guard, report: Report,
                compiled: bool = False) -> None:
    """Parts b and c share one random pair, built once (and part d times its decode step on the smaller one)."""
    if guard.over("b, c"):
        report.skip("b", "cost curves", guard)
        report.skip("c", "per-round overhead", guard)
        if compiled:
            report.skip("d", "compiled step", guard)
        return
    root = tmp / "shaped"
    vocab = plan.target_shape["vocab_size"]
    t0 = time.monotonic()
    try:
        tokenizer = tm.build_small_vocab_tokenizer(root / "tokenizer", words=vocab - 2)
        folders = root / "target", root / "drafter"
        target = build_shaped(plan.target_shape, 1, device, tokenizer, folders[0], tm)
        draft = build_shaped(plan.draft_shape, 2, device, tokenizer, folders[1], tm)
    except Exception as exc:
        report.error("b", "building the random pair", exc)
        return
    log(f"random {plan.shape_names[0]} / {plan.shape_names[1]} pair built and saved in {time.monotonic() - t0:.1f} s")
    part_costs(plan, device, [(plan.shape_names[0], target), (plan.shape_names[1], draft)], guard, report)
    part_overhead(plan, device, (target, draft), folders, guard, report)
    if compiled:
        part_compiled(plan, device, tmp, tm, guard, report, draft, f"{plan.shape_names[1]} bf16")
    del target, draft
    free_memory(device)


# ---------------------------------------------------------------------------------------------- d: compiled step


COMPILED_BUCKETS = (1, 2, 4, 8)


def spec_greedy(lm, prompt: list[int], n: int, truth: list[int]) -> list[int]:
    """Greedy speculative rounds on one cache handle with drafts of 0, 1, 3 and 7 tokens taken from ``truth``,
    every other one half wrong (several buckets, rejections that crop and continue); returns the n tokens."""
    lm.feed(prompt[:-1], last_logits_only=True)
    out, pending, rnd = [], prompt[-1], 0
    while len(out) < n:
        size, right = (0, 1, 3, 7)[rnd % 4], truth[len(out):]
        draft = right[:size] if rnd % 2 == 0 else [*right[: size // 2], 3, 3, 3, 3, 3, 3, 3][:size]
        draft = draft[: max(0, n - len(out) - 1)]
        logits, _ = lm.feed([pending, *draft])
        base = lm.length - len(draft) - 1
        picks = logits.argmax(-1).tolist()
        accepted = 0
        while accepted < len(draft) and draft[accepted] == picks[accepted]:
            accepted += 1
        out += [*draft[:accepted], picks[accepted]]
        lm.crop(base + 1 + accepted)
        pending, rnd = out[-1], rnd + 1
    return out[:n]


def step_ms(lm, prefix: list[int], reps: int, device: str) -> float:
    """Median ms of one single-token decode step after ``prefix`` (cropped back after each)."""
    lm.feed(prefix, last_logits_only=True)
    times = []
    for rep in range(reps + 3):  # three untimed warm-ups
        sync(device)
        t0 = time.perf_counter()
        lm.feed(prefix[-1:])
        sync(device)
        if rep >= 3:
            times.append(time.perf_counter() - t0)
        lm.crop(len(prefix))
    lm.close()
    return 1000 * statistics.median(times)


def part_compiled(plan: Plan, device: str, tmp: Path, tm, guard: Guard, report: Report, timed=None,
                  timed_name: str = "") -> None:
    """``backend: compiled`` (``shared.backend.CompiledBackend``; CUDA: mode reduce-overhead, CUDA graphs): greedy
    identity of speculative rounds on tiny float32 targets against ``generate``, then ms per single-token decode
    step of ``timed`` (a random model) on the compiled step, the eager static slots and a dynamic cache."""
    import torch

    from shared.backend import CompiledBackend, StaticBackend
    from shared.kv import CachedLM

    root = tmp / "compiled"
    tokenizer = root / "tokenizer"
    tm.build_tokenizer(tokenizer)
    prompts, n = IDENTITY_PROMPTS[: plan.prompts], plan.identity_tokens
    raw = report.raw.setdefault("compiled", {"identity": [], "timing": None})
    for arch in plan.archs:
        if guard.over(f"d {arch}"):
            report.skip("d", f"compiled {arch}", guard)
            continue
        try:
            folder = tm.build_model(root / f"{arch}-target", arch, tokenizer, seed=1, layers=2)
            model = load_on(folder, device, "float32")
            expected = [hf_generate(model, p, n, device) for p in prompts]
            backend = CompiledBackend(model, 2, 256, COMPILED_BUCKETS)
            backend.warm_up()
            got = []
            for p, truth in zip(prompts, expected):
                handle = backend.open()
                got.append(spec_greedy(handle, p, n, truth))
                handle.close()
            matches = sum(a == b for a, b in zip(got, expected))
            compile_s = " · ".join(f"{b}: {s:.1f}" for b, s in backend.compile_s.items())
            detail = (f"mode {backend.mode or 'default'}; compile s per bucket {compile_s or '—'}; "
                      f"{backend.compiled_steps} compiled steps")
            if backend.failure:
                detail = f"compile failed, eager fallback: {backend.failure}"
                report.failed.append(f"d compiled {arch}: {backend.failure}")
            elif matches < len(prompts):
                report.failed.append(f"d compiled {arch}: {len(prompts) - matches} prompt(s) differ from generate")
            raw["identity"].append({"arch": arch, "matches": matches, "prompts": len(prompts),
                                    "compile_s": backend.compile_s, "failure": backend.failure,
                                    "compiled_steps": backend.compiled_steps})
            report.row("d", f"compiled {arch} float32 greedy", f"{matches}/{len(prompts)} prompts match", detail)
            del model, backend
            free_memory(device)
        except Exception as exc:
            report.error("d", f"compiled {arch}", exc)
    if timed is None or guard.over("d timing"):
        if timed is not None:
            report.skip("d", "compiled step timing", guard)
        return
    try:
        vocab = timed.config.vocab_size
        prefix = torch.randint(2, vocab, (plan.prefix_len,), generator=torch.Generator().manual_seed(0)).tolist()
        slot_tokens = 2 * plan.prefix_len + 56
        t0 = time.monotonic()
        compiled = CompiledBackend(timed, 1, slot_tokens, (1,))
        compiled.warm_up()
        ms = {"dynamic": step_ms(CachedLM(timed), prefix, plan.reps, device)}
        static = StaticBackend(timed, 1, slot_tokens)
        ms["static"] = step_ms(static.open(), prefix, plan.reps, device)
        del static
        ms["compiled"] = step_ms(compiled.open(), prefix, plan.reps, device)
        raw["timing"] = {"model": timed_name, "ms": ms, "compile_s": compiled.compile_s, "failure": compiled.failure,
                         "slot_tokens": slot_tokens, "prefix_len": plan.prefix_len}
        detail = (f"prefix {plan.prefix_len}, slot {slot_tokens}; mode {compiled.mode or 'default'}, compile "
                  f"{compiled.compile_s.get(1, float('nan')):.1f} s; whole part {time.monotonic() - t0:.0f} s")
        if compiled.failure:
            detail += f"; compile FAILED, eager: {compiled.failure}"
        report.row("d", f"{timed_name}: ms per 1-token step dynamic · static · compiled",
                   " · ".join(f"{ms[k]:.2f}" for k in ("dynamic", "static", "compiled")), detail)
        del compiled
        free_memory(device)
    except Exception as exc:
        report.error("d", "compiled step timing", exc)


# ---------------------------------------------------------------------------------------------- output


def markdown(meta: dict[str, Any], rows: list[dict[str, str]], notes: list[str]) -> str:
    lines = ["# pipespec GPU check", "",
             f"- date: {meta['date']}",
             f"- device: {meta['device']} — {meta['device_name']}",
             "- versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
             f"- mode: {meta['mode']}; budget {meta['budget_s']:.0f} s; elapsed {meta['elapsed_s']:.1f} s",
             "", "| part | item | result | detail |", "|---|---|---|---|"]
    lines += [f"| {r['part']} | {r['item']} | {r['result']} | {r['detail']} |" for r in rows]
    if notes:
        lines += ["", *(f"- {note}" for note in notes)]
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0", help="device of both nodes and of the references (default cuda:0)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="tiny models everywhere (a CPU smoke: --device cpu --quick)")
    mode.add_argument("--smoke", action="store_true", help="smaller still: one arch, float32, short runs (the test)")
    p.add_argument("--out", type=Path, help="folder for gpu_check.md and gpu_check.json")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                   help=f"seconds after which what is left is skipped (default {DEFAULT_BUDGET_S:.0f})")
    p.add_argument("--parallel", type=int, help="identity clusters run at once (default: cores // 2, 1 to 8)")
    p.add_argument("--compiled", action="store_true",
                   help="part d (the compiled backend) on the CPU too (always on a GPU)")
    p.add_argument("--install-wheels", type=Path, metavar="DIR",
                   help="first pip install --no-index the wheels in DIR (e.g. pyzmq) into --wheels-target")
    p.add_argument("--wheels-target", type=Path, default=Path(tempfile.gettempdir()) / "pipespec-gpu-check-site",
                   help="where --install-wheels installs (put on the path of this run and its nodes)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    guard = Guard(args.budget)
    if args.install_wheels:
        install_wheels(args.install_wheels, args.wheels_target)
    missing = missing_imports()
    if missing:
        print("gpu_check: missing Python packages: " + "; ".join(missing) + "\n"
              "Carry them as wheels in the tree: on a machine with pip access `python3 -m pip download --no-deps "
              "--only-binary=:all: --python-version X.Y --implementation cp --platform manylinux_2_28_x86_64 "
              "--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d wheels pyzmq msgpack` "
              f"(X.Y = this machine's Python, {platform.python_version()}), here "
              "`python3 scripts/gpu_check.py --install-wheels wheels ...` (see the script's docstring).",
              file=sys.stderr)
        return 2
    # a bare GPU machine runs this from a copy of the tree, no install: the repo root makes runtime/ and testkit/
    # importable (the nodes get it through PYTHONPATH)
    sys.path.insert(0, str(REPO_ROOT))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        print(f"gpu_check: --device {device} but torch {torch.__version__} sees no CUDA device "
              "(use --device cpu --quick for a CPU smoke)", file=sys.stderr)
        return 2
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    plan = PLANS[mode]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    parallel = args.parallel or max(1, min(8, cores // 2))
    torch.set_num_threads(1 if device == "cpu" else 4)  # the CPU smoke shares its cores with the nodes
    meta = {"date": dt.datetime.now().isoformat(timespec="seconds"), "device": device,
            "device_name": device_name(device), "versions": versions(), "mode": mode, "budget_s": args.budget,
            "parallel": parallel}
    log(f"{meta['device_name']}; " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
        + f"; mode {mode}, budget {args.budget:.0f} s, {parallel} identity cluster(s) at once")
    tm = load_tiny_models()
    report = Report()
    with tempfile.TemporaryDirectory(prefix="pipespec-gpu-check-") as tmp:
        if preflight(device, tm, report):
            try:
                part_identity(plan, device, Path(tmp), tm, guard, report, parallel)
            except Exception as exc:
                report.error("a", "greedy identity", exc)
            free_memory(device)
            # d: the compiled backend on a GPU (CUDA graphs); on the CPU only when asked (inductor, slow to compile)
            part_models(plan, device, Path(tmp), tm, guard, report,
                        compiled=device.startswith("cuda") or args.compiled)
    meta["elapsed_s"] = guard.elapsed()
    notes = []
    if guard.skipped:
        notes.append(f"skipped after the {args.budget:.0f} s budget: " + ", ".join(guard.skipped))
    notes += [f"FAILED: {f.splitlines()[0]}" for f in report.failed]
    text = markdown(meta, report.rows, notes)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_check.md").write_text(text)
        from benchmarks.results import write_result  # importable once main() put the repo root on the path

        write_result(args.out / "gpu_check.json",
                     {"meta": meta, "rows": report.rows, "notes": notes, "raw": report.raw})
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
