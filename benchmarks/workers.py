"""Processes the benchmarks start for transformers rows: a persistent worker (parent side :class:`Worker`, child
side :func:`worker_main`, JSON lines over stdin/stdout) and a one-job worker of a script (:func:`run_script_worker`),
plus what runs inside them (counting drafts in assisted generation, a batched greedy generate).

Run as a module only as a worker: ``python -m benchmarks.workers --worker SPEC_JSON`` (started by :class:`Worker`).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks import progress
from benchmarks.passes import HFSetup
from benchmarks.progress import log

REPO_ROOT = Path(__file__).resolve().parent.parent


def _worker_env(threads: int) -> dict[str, str]:
    """A worker's environment: its thread count, and the repo root importable (it runs from a checkout)."""
    n = str(threads)
    return {**os.environ, "OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}


def run_script_worker(script: Path, job_path: Path, threads: int, label: str) -> None:
    """Run ``script --_hf-worker job_path`` in a subprocess at ``threads`` threads (a one-job worker, for scripts
    whose rows need no persistent process), passing its progress through; raise with the end of its stderr if it
    fails."""
    proc = subprocess.Popen([sys.executable, str(script), "--_hf-worker", str(job_path)], env=_worker_env(threads),
                            cwd=REPO_ROOT,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    tail: deque[str] = deque(maxlen=30)
    assert proc.stderr is not None
    for line in proc.stderr:  # pass progress through, keep the end for an error report
        sys.stderr.write(line)
        tail.append(line.rstrip())
    code = proc.wait()
    if code != 0:
        raise WorkerError(f"{label} exited with code {code}:\n" + "\n".join(tail))


class WorkerError(RuntimeError):
    """A worker request failed; the message carries the error (and the end of the worker's log if it died)."""


class Worker:
    """Parent side of one persistent transformers worker: a subprocess at a fixed thread count and dtype."""

    def __init__(self, setup: HFSetup):
        self.setup = setup
        spec = {"start": progress.start_time(), "key": setup.key, "dtype": setup.dtype, "threads": setup.threads,
                "device": setup.device, "target": setup.target_path}
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.workers", "--worker", json.dumps(spec)],
                                     env=_worker_env(setup.threads), cwd=REPO_ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        self.tail: deque[str] = deque(maxlen=30)
        self._stderr = threading.Thread(target=self._pass_stderr, daemon=True)
        self._stderr.start()

    def _pass_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:  # progress through to our stderr, the end kept for an error report
            sys.stderr.write(line)
            self.tail.append(line.rstrip())

    def call(self, op: str, **request: Any) -> dict[str, Any]:
        """Send one request, wait for its answer (blocking); raise :class:`WorkerError` on an error answer."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps({"op": op, **request}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            code = self.proc.wait()
            self._stderr.join(5)
            raise WorkerError(f"worker {self.setup.key} exited with code {code}:\n" + "\n".join(self.tail))
        answer = json.loads(line)
        if "error" in answer:
            raise WorkerError(answer["error"])
        return answer

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(WorkerError):
                self.call("quit")
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._stderr.join(5)


class DraftCounter:
    """Counts drafts and acceptances inside transformers' assisted generation (any strategy: assistant model,
    prompt lookup, early exit, different tokenizers) by wrapping the candidate generator ``generate`` builds."""

    def __init__(self) -> None:
        self.rounds = self.drafts = self.draft_tokens = self.accepted_tokens = 0
        self.draft_s = 0.0  # time inside the candidate generator (get_candidates)
        self.settings: dict[str, Any] = {}  # the assistant settings transformers used (its defaults unless set)
        self.generator = ""  # the candidate generator class transformers chose

    def stats(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in ("rounds", "drafts", "draft_tokens", "accepted_tokens",
                                                       "draft_s")}

    def _wrap(self, gen: Any) -> Any:
        get, update = gen.get_candidates, gen.update_candidate_strategy
        counter = self
        self.generator = type(gen).__name__
        cfg = getattr(gen, "assistant_generation_config", None) or getattr(gen, "generation_config", None)
        if cfg is not None and not self.settings:
            self.settings = {name: getattr(cfg, name, None) for name in (
                "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
                "prompt_lookup_num_tokens", "max_matching_ngram_size", "assistant_early_exit")
                if getattr(cfg, name, None) is not None}

        def get_candidates(input_ids: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return get(input_ids, **kwargs)
            finally:
                counter.draft_s += time.perf_counter() - t0

        def update_candidate_strategy(input_ids: Any, scores: Any, num_matches: Any) -> Any:
            drafted = int(scores.shape[1]) - 1  # scores cover the candidates + the bonus position
            counter.rounds += 1
            if drafted > 0:
                counter.drafts += 1
                counter.draft_tokens += drafted
                counter.accepted_tokens += int(num_matches)
            return update(input_ids, scores, num_matches)

        gen.get_candidates = get_candidates
        gen.update_candidate_strategy = update_candidate_strategy
        return gen

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        from transformers.generation.utils import GenerationMixin

        build = GenerationMixin._get_candidate_generator
        counter = self

        def _get_candidate_generator(model: Any, *args: Any, **kwargs: Any) -> Any:
            return counter._wrap(build(model, *args, **kwargs))

        GenerationMixin._get_candidate_generator = _get_candidate_generator
        try:
            yield
        finally:
            GenerationMixin._get_candidate_generator = build


def worker_main(spec_json: str) -> int:
    """Child side: load the target, then answer JSON-line requests on stdin until ``quit``.

    Requests: ``ready``; ``generate`` (``ids``, ``max_new_tokens``, ``strategy``: ``{"kind": "target" | "assistant"
    | "universal" | "early_exit" | "prompt_lookup", ...}``) → ``token_ids``, ``time_s`` (around ``generate`` only),
    ``stats``, ``generator``, ``settings``; ``generate_batch`` (``ids``: a list of prompts, ``max_new_tokens``): the
    target alone on all of them left-padded into one batch, greedy → ``token_ids`` (one list per prompt, cut after
    its first end token, so no padding), ``time_s``, ``width`` (the padded prompt length); ``curve`` (``model``:
    ``"target"`` or a path, ``sizes``, ``prefix_len``, ``budget_s``, ``repeats``) → ``sizes``, ``seconds``,
    ``prefix_len``; ``quit``. A failing request answers ``{"error": ...}`` and the worker goes on.
    """
    spec = json.loads(spec_json)
    progress.set_start(spec["start"])
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything a library prints goes to stderr, never into the protocol
    sys.stdout = sys.stderr
    import torch
    import transformers

    from shared.costs.measure import measure_curve
    from shared.devices import input_device
    from shared.models import load_causal_lm, load_tokenizer, set_threads

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    set_threads(spec["threads"])
    t0 = time.perf_counter()
    target = load_causal_lm(spec["target"], spec["device"], spec["dtype"])
    load_s = time.perf_counter() - t0
    log(f"worker {spec['key']}: target loaded in {load_s:.1f} s (torch threads {torch.get_num_threads()})")
    models: dict[str, Any] = {"target": target}
    tokenizers: dict[str, Any] = {}

    def model(path: str) -> Any:
        if path not in models:
            t0 = time.perf_counter()
            models[path] = load_causal_lm(path, spec["device"], spec["dtype"])
            log(f"worker {spec['key']}: {Path(path).name} loaded in {time.perf_counter() - t0:.1f} s")
        return models[path]

    def tokenizer(path: str) -> Any:
        if path not in tokenizers:
            tokenizers[path] = load_tokenizer(path)
        return tokenizers[path]

    def generate_kwargs(s: dict[str, Any]) -> dict[str, Any]:
        kind = s["kind"]
        if kind == "target":
            return {}
        if kind == "prompt_lookup":
            return {"prompt_lookup_num_tokens": s["prompt_lookup_num_tokens"],
                    "max_matching_ngram_size": s["max_matching_ngram_size"]}
        if kind == "early_exit":
            return {"assistant_early_exit": s["assistant_early_exit"]}
        if kind not in ("assistant", "universal"):
            raise ValueError(f"unknown strategy {kind!r}")
        kwargs = {"assistant_model": model(s["model"])}
        if kind == "universal":
            kwargs |= {"tokenizer": tokenizer(spec["target"]), "assistant_tokenizer": tokenizer(s["model"])}
        return kwargs

    def handle(req: dict[str, Any]) -> dict[str, Any]:
        op = req["op"]
        if op in ("ready", "quit"):
            return {"load_s": load_s}
        if op == "curve":
            with torch.inference_mode():
                c = measure_curve(model(req["model"]) if req["model"] != "target" else target, req["sizes"],
                                  prefix_len=req["prefix_len"], budget_s=req["budget_s"], repeats=req["repeats"])
            return {"sizes": list(c.sizes), "seconds": list(c.seconds), "prefix_len": c.prefix_len}
        if op == "generate":
            kwargs = generate_kwargs(req["strategy"])
            ids = torch.tensor([req["ids"]], dtype=torch.long, device=input_device(target))
            counter = DraftCounter()
            with counter.patched():
                t0 = time.perf_counter()
                out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=req["max_new_tokens"], **kwargs)
                tokens = out[0, ids.shape[1]:].tolist()  # .tolist() waits for a GPU too
                elapsed = time.perf_counter() - t0
            return {"token_ids": tokens, "time_s": elapsed, "stats": counter.stats(), "generator": counter.generator,
                    "settings": counter.settings}
        if op == "generate_batch":
            return generate_batch(target, req["ids"], req["max_new_tokens"])
        raise ValueError(f"unknown request {op!r}")

    while line := sys.stdin.readline():
        req = json.loads(line)
        try:
            answer = handle(req)
        except Exception as exc:  # a strategy transformers refuses on this model is a row error, not a dead worker
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        proto.write(json.dumps(answer) + "\n")
        if req["op"] == "quit":
            break
    return 0


def generate_batch(model: Any, prompts: list[list[int]], max_new_tokens: int) -> dict[str, Any]:
    """Greedy ``generate`` on ``prompts`` left-padded into one batch (with the attention mask): the new tokens of each
    prompt, cut after its first end token (rows that end early are padded by ``generate`` until the batch ends)."""
    import torch

    from shared.devices import input_device

    if not prompts or not all(prompts):
        raise ValueError("generate_batch needs at least one prompt, none of them empty")
    config = model.generation_config
    eos = config.eos_token_id
    eos = [] if eos is None else [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0)
    width = max(len(p) for p in prompts)
    device = input_device(model)
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long, device=device)
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                         pad_token_id=pad)
    rows = out[:, width:].tolist()  # .tolist() waits for a GPU too
    elapsed = time.perf_counter() - t0
    token_ids = []
    for row in rows:
        end = next((i for i, t in enumerate(row) if t in eos), None)
        token_ids.append(row if end is None else row[: end + 1])
    return {"token_ids": token_ids, "time_s": elapsed, "width": width}


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(worker_main(sys.argv[2]))
    sys.exit("usage: python -m benchmarks.workers --worker SPEC_JSON (started by the benchmarks, not by hand)")
