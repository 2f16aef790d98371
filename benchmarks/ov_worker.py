"""The OpenVINO GenAI worker of the drafter-type benchmark's ``ov-*`` rows (parent side: :mod:`benchmarks.ov_genai`).

It runs in the OpenVINO virtual environment the bench makes (``~/.cache/pipespec/openvino/venv``), not in
pipespec's: that one has transformers 5.x, which optimum-intel does not accept. So this file imports nothing from
pipespec, only the standard library, numpy and OpenVINO (lazily, so that the tests import its pure parts without
OpenVINO installed). It is started as ``venv/bin/python -I ov_worker.py SPEC_JSON`` (``-I``: neither this folder
nor ``PYTHONPATH`` on the path) and answers JSON lines on stdin/stdout, one answer per request:

- ``ready`` → ``versions`` (openvino, openvino_genai, openvino_tokenizers), ``properties`` (what was asked of the CPU
  plugin) and ``resolved`` (what a model compiled with them reports: on a CPU without native bf16 the plugin runs
  f32 whatever the hint says);
- ``curve`` (``model``: ``"target"`` or ``"draft"``, ``sizes``, ``prefix_len``, ``budget_s``, ``repeats``) →
  ``sizes``, ``seconds``, ``prefix_len``, ``resolved``: forwards of n new tokens on a cached ``prefix_len``-token
  prefix of the exported stateful model, compiled with the same properties (the fastest of a warm-up and up to
  ``repeats`` more per size, within ``budget_s``; the compiled model is released before the answer);
- ``load`` → ``load_s``: build the ``LLMPipeline`` (with ``draft_model`` when the spec has a draft);
- ``generate`` (``ids``, ``max_new_tokens``) → ``token_ids``, ``time_s`` (wall time around ``generate``), ``stats``
  (``rounds``, ``drafts``, ``draft_tokens``, ``accepted_tokens``), ``perf`` (GenAI's own metrics) and ``settings``
  (the generation config used); greedy, the prompt given as token ids (no chat template, no tokenizer on the way
  in), the pipeline built first if ``load`` was not sent;
- ``quit``.

A failing request answers ``{"error": "..."}`` and the worker goes on.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from typing import IO, Any

#: What the CPU plugin is asked for (besides the thread count); the answer of ``ready`` says what it resolved to.
PRECISION_HINT = "INFERENCE_PRECISION_HINT"
THREADS = "INFERENCE_NUM_THREADS"
#: Compiled-model properties recorded beside the precision: they change the arithmetic (and so possibly the greedy
#: tokens), not only the speed.
RECORDED = (PRECISION_HINT, THREADS, "KV_CACHE_PRECISION", "DYNAMIC_QUANTIZATION_GROUP_SIZE", "EXECUTION_MODE_HINT")
#: Generation-config fields reported with each answer (what GenAI read from the export's generation_config.json
#: plus what the worker set).
SETTINGS = ("max_new_tokens", "do_sample", "num_assistant_tokens", "assistant_confidence_threshold",
            "repetition_penalty", "presence_penalty", "frequency_penalty", "no_repeat_ngram_size", "eos_token_id",
            "stop_token_ids", "ignore_eos", "min_new_tokens")


def plugin_properties(spec: dict[str, Any]) -> dict[str, Any]:
    """The CPU plugin properties of the spec: the precision hint and the thread count (and nothing else: the rest
    stays OpenVINO's default, recorded as resolved)."""
    threads = int(spec["threads"])
    if threads < 1:
        raise ValueError(f"threads must be ≥ 1, got {threads}")
    return {PRECISION_HINT: str(spec.get("precision", "bf16")), THREADS: threads}


def settings_of(config: Any) -> dict[str, Any]:
    """The :data:`SETTINGS` fields of a GenAI ``GenerationConfig`` as JSON values (sets as sorted lists)."""
    out: dict[str, Any] = {}
    for name in SETTINGS:
        value = getattr(config, name, None)
        if value is None:
            continue
        if isinstance(value, (set, frozenset, list, tuple)):
            value = sorted(int(v) for v in value)
        elif not isinstance(value, (bool, int, float, str)):
            value = str(value)
        out[name] = value
    return out


def draft_stats(n_tokens: int, steps: list[int] | None, accepted: int | None, draft_tokens: int | None,
                drafting: bool) -> dict[str, Any]:
    """The bench's draft counters of one generation of ``n_tokens`` tokens.

    ``steps``: the tokens each target inference emitted (the main model's ``m_batch_sizes``: the prompt's forward 1,
    then each verification step its accepted drafts + 1); ``accepted`` and ``draft_tokens``: GenAI's own counters
    (``get_num_accepted_tokens``, ``get_num_draft_tokens``). On this GenAI version those counters leave out the
    last verification step of a generation (a model drafting for itself, 12 tokens, 3 drafts per step, emits
    1, 4, 4, 3 and reports 6 drafted, 6 accepted), so α, τ and k are taken over the steps they count: ``drafts`` =
    the verification steps but the last, checked against ``steps`` (their accepted drafts must sum to
    ``accepted``; else ``drafts`` is every step and ``counted`` says so). ``rounds``: every target step after the
    prompt's forward; the target alone has ``n_tokens`` - 1 of them and no drafts."""
    if steps is not None and sum(steps) != n_tokens:
        raise ValueError(f"the target's steps emitted {sum(steps)} tokens, the generation has {n_tokens}")
    rounds = max(len(steps) - 1, 0) if steps else max(n_tokens - 1, 0)
    stats: dict[str, Any] = {"rounds": rounds, "drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
    if not drafting:
        return stats
    if accepted is None or draft_tokens is None:
        stats["counted"] = "none: this GenAI reports no draft counters"
        return stats
    if accepted > (draft_tokens or 0):
        raise ValueError(f"{accepted} accepted draft tokens of {draft_tokens} drafted")
    counted = steps[1:-1] if steps else None
    if counted is not None and sum(b - 1 for b in counted) == accepted:
        drafts, how = len(counted), "GenAI's counters: every verification step but the last"
    else:
        drafts, how = rounds, "GenAI's counters, over every verification step"
    stats |= {"drafts": drafts if draft_tokens else 0, "draft_tokens": int(draft_tokens),
              "accepted_tokens": int(accepted), "counted": how}
    return stats


def serve(lines: Iterable[str], out: IO[str], handle: Callable[[dict[str, Any]], dict[str, Any]]) -> int:
    """Answer each JSON request line with ``handle``'s answer (an exception becomes ``{"error": ...}``) until
    ``quit`` or the end of input; 0."""
    for line in lines:
        if not line.strip():
            continue
        op = None
        try:
            req = json.loads(line)
            if not isinstance(req, dict) or not isinstance(req.get("op"), str):
                raise ValueError(f"a request is an object with an 'op' string, got {line.strip()[:200]!r}")
            op = req["op"]
            answer = handle(req)
        except Exception as exc:  # a request OpenVINO refuses is a row error, not a dead worker
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(answer) + "\n")
        out.flush()
        if op == "quit":
            break
    return 0


def log(message: str) -> None:
    print(f"[openvino worker] {message}", file=sys.stderr, flush=True)


class State:
    """The worker's models: the spec (``key``, ``target``, ``draft`` or None: exported folders; ``threads``,
    ``precision``, ``draft_tokens``) and the pipeline once built."""

    def __init__(self, spec: dict[str, Any]):
        import openvino as ov

        self.spec = spec
        self.props = plugin_properties(spec)
        self.core = ov.Core()
        self.pipe: Any = None

    def versions(self) -> dict[str, str]:
        import openvino as ov
        import openvino_genai

        out = {"openvino": ov.get_version(), "openvino_genai": getattr(openvino_genai, "__version__", "?")}
        try:
            import openvino_tokenizers

            out["openvino_tokenizers"] = getattr(openvino_tokenizers, "__version__", "?")
        except ImportError:
            pass
        return out

    def resolved(self, compiled: Any) -> dict[str, str]:
        out = {}
        for name in RECORDED:
            try:
                value = compiled.get_property(name)
            except Exception:  # a property this plugin version does not have
                continue
            out[name] = value.get_type_name() if hasattr(value, "get_type_name") else str(value)
        return out

    def probe(self) -> dict[str, str]:
        """The properties a model compiled with the spec's reports: a one-MatMul model (cheap), because the plugin
        resolves the precision hint per host, not per model."""
        import numpy as np
        import openvino as ov
        import openvino.opset13 as ops

        x = ops.parameter([1, 16], ov.Type.f32, name="x")
        w = ops.constant(np.ones((16, 16), dtype=np.float32))
        model = ov.Model([ops.matmul(x, w, False, False)], [x], "probe")
        return self.resolved(self.core.compile_model(model, "CPU", self.props))

    def load(self) -> float:
        import openvino_genai

        if self.pipe is not None:
            return 0.0
        t0 = time.perf_counter()
        kwargs: dict[str, Any] = dict(self.props)
        # no prefix cache: every row processes each prompt in full (the warm-up decodes the first prompt)
        scheduler = openvino_genai.SchedulerConfig()
        scheduler.enable_prefix_caching = False
        kwargs["scheduler_config"] = scheduler
        if self.spec.get("draft"):
            kwargs["draft_model"] = openvino_genai.draft_model(self.spec["draft"], "CPU", **self.props)
        self.pipe = openvino_genai.LLMPipeline(self.spec["target"], "CPU", **kwargs)
        load_s = time.perf_counter() - t0
        log(f"{self.spec['key']}: pipeline built in {load_s:.1f} s")
        return load_s

    def generate(self, ids: list[int], max_new_tokens: int) -> dict[str, Any]:
        import numpy as np
        import openvino as ov
        import openvino_genai

        if not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise ValueError("generate needs a non-empty list of token ids")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
        self.load()
        drafting = bool(self.spec.get("draft"))
        config = self.pipe.get_generation_config()
        config.max_new_tokens = int(max_new_tokens)
        config.do_sample = False  # greedy: see benchmarks/ov_genai.py for why the sampled path is not run
        if drafting:
            config.num_assistant_tokens = int(self.spec["draft_tokens"])
        apply_stops(config, stop_fields(self.spec["target"]))
        arr = np.array([ids], dtype=np.int64)
        inputs = openvino_genai.TokenizedInputs(ov.Tensor(arr), ov.Tensor(np.ones_like(arr)))
        t0 = time.perf_counter()
        result = self.pipe.generate(inputs, config)
        elapsed = time.perf_counter() - t0
        tokens = [int(t) for t in result.tokens[0]]
        perf, steps, accepted, drafted = perf_of(result, drafting)
        return {"token_ids": tokens, "time_s": elapsed,
                "stats": draft_stats(len(tokens), steps, accepted, drafted, drafting), "perf": perf,
                "settings": settings_of(config)}

    def curve(self, model: str, sizes: list[int], prefix_len: int, budget_s: float, repeats: int) -> dict[str, Any]:
        folder = self.spec.get(model) if model in ("target", "draft") else None
        if not folder:
            raise ValueError(f"no {model!r} model in this worker")
        compiled = self.core.compile_model(os.path.join(folder, "openvino_model.xml"), "CPU", self.props)
        try:
            resolved = self.resolved(compiled)
            vocab = vocab_size(folder)
            sizes_out, seconds = measure_forwards(compiled, vocab, sizes, prefix_len, budget_s, repeats)
        finally:
            del compiled
            gc.collect()  # the curve's copy of the weights goes before the pipeline loads its own
        return {"sizes": sizes_out, "seconds": seconds, "prefix_len": prefix_len, "resolved": resolved}

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req["op"]
        if op == "ready":
            return {"versions": self.versions(), "properties": self.props, "resolved": self.probe()}
        if op == "quit":
            return {}
        if op == "load":
            return {"load_s": self.load()}
        if op == "generate":
            return self.generate(req["ids"], int(req["max_new_tokens"]))
        if op == "curve":
            return self.curve(req["model"], [int(n) for n in req["sizes"]], int(req["prefix_len"]),
                              float(req["budget_s"]), int(req["repeats"]))
        raise ValueError(f"unknown request {op!r}")


def perf_of(result: Any, drafting: bool) -> tuple[dict[str, Any], list[int] | None, int | None, int | None]:
    """GenAI's metrics of one generation (ms, means), the tokens each target inference emitted (None where this
    version does not say) and, for speculative decoding, its accepted and drafted token counters (None where not
    reported); see :func:`draft_stats`."""
    perf: dict[str, Any] = {}
    pm = getattr(result, "perf_metrics", None)
    if pm is not None:
        for name, getter in (("ttft_ms", "get_ttft"), ("tpot_ms", "get_tpot"),
                             ("generate_ms", "get_generate_duration"), ("inference_ms", "get_inference_duration")):
            with contextlib.suppress(Exception):
                perf[name] = float(getattr(pm, getter)().mean)
        for name, getter in (("generated_tokens", "get_num_generated_tokens"),
                             ("input_tokens", "get_num_input_tokens")):
            with contextlib.suppress(Exception):
                perf[name] = int(getattr(pm, getter)())
    ext = getattr(result, "extended_perf_metrics", None) if drafting else None
    main = getattr(ext, "main_model_metrics", None) if ext is not None else pm
    steps = None
    with contextlib.suppress(Exception):
        steps = [int(b) for b in main.raw_metrics.m_batch_sizes]
    accepted = drafted = None
    if ext is not None:
        with contextlib.suppress(Exception):
            accepted = int(ext.get_num_accepted_tokens())
        with contextlib.suppress(Exception):
            drafted = int(ext.get_num_draft_tokens())
        with contextlib.suppress(Exception):
            perf["draft_acceptance_rate"] = float(ext.get_draft_acceptance_rate())
        with contextlib.suppress(Exception):
            perf["draft_model_inferences"] = len(ext.draft_model_metrics.raw_metrics.m_durations)
        perf |= {"num_accepted_tokens": accepted, "num_draft_tokens": drafted}
    perf["target_steps"] = steps
    return perf, steps, accepted, drafted


def stop_fields(folder: str) -> dict[str, Any]:
    """What transformers' ``generate(do_sample=False)`` takes from a model folder besides greedy: its end tokens
    (``eos_token_id`` of generation_config.json, else of config.json, as a list) and ``repetition_penalty`` where
    generation_config.json sets one."""
    def read(name: str) -> dict[str, Any]:
        try:
            with open(os.path.join(folder, name)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    gen, cfg = read("generation_config.json"), read("config.json")
    eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
    eos = [] if eos is None else [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]
    out: dict[str, Any] = {"eos": eos}
    if gen.get("repetition_penalty") is not None:
        out["repetition_penalty"] = float(gen["repetition_penalty"])
    return out


def apply_stops(config: Any, fields: dict[str, Any]) -> None:
    """Set the end tokens and repetition penalty of :func:`stop_fields` on a GenAI generation config: the pipeline
    with a draft model does not read them from the export (its config comes back with ``eos_token_id`` -1 and no
    stop tokens), the one without does; set on both, so both stop where transformers does."""
    if fields["eos"]:
        config.set_eos_token_id(fields["eos"][0])
        config.stop_token_ids = set(fields["eos"])
    if "repetition_penalty" in fields:
        config.repetition_penalty = fields["repetition_penalty"]


def vocab_size(folder: str) -> int:
    with open(os.path.join(folder, "config.json")) as f:
        return int(json.load(f)["vocab_size"])


def measure_forwards(compiled: Any, vocab: int, sizes: list[int], prefix_len: int, budget_s: float,
                     repeats: int) -> tuple[list[int], list[float]]:
    """Forward seconds of n new tokens on a cached ``prefix_len``-token prefix of a compiled stateful LLM (inputs
    ``input_ids``, ``attention_mask``, ``position_ids``, ``beam_idx`` as optimum exports them), random ids; the
    cache is restored to the prefix after each forward (its state copied once), or, where the plugin cannot set
    its state, rebuilt with a prefill. The fastest of a warm-up and up to ``repeats`` more per size while
    ``budget_s`` allows (the first size always measured); sizes that do not fit the budget are left out."""
    import numpy as np
    import openvino as ov

    wanted = sorted({n for n in sizes if n >= 1})
    if not wanted:
        raise ValueError(f"no size ≥ 1 in {sizes!r}")
    names = {name for port in compiled.inputs for name in port.get_names()}
    rng = np.random.default_rng(1234)
    req = compiled.create_infer_request()
    start = time.perf_counter()

    def feed(n: int, past: int) -> float:
        ids = rng.integers(0, vocab, size=(1, n), dtype=np.int64)
        inputs = {"input_ids": ids, "attention_mask": np.ones((1, past + n), dtype=np.int64)}
        if "position_ids" in names:
            inputs["position_ids"] = np.arange(past, past + n, dtype=np.int64)[None]
        if "beam_idx" in names:
            inputs["beam_idx"] = np.zeros(1, dtype=np.int32)
        t0 = time.perf_counter()
        req.infer(inputs)
        return time.perf_counter() - t0

    req.reset_state()
    if prefix_len:
        feed(prefix_len, 0)
    saved: list[tuple[Any, Any]] | None
    try:
        saved = [(s, np.array(s.state.data, copy=True)) for s in req.query_state()]
    except Exception:
        saved = None

    def restore() -> None:
        nonlocal saved
        if saved is not None:
            try:
                for s, data in saved:
                    s.state = ov.Tensor(data.copy())
                return
            except Exception:
                saved = None
        req.reset_state()
        if prefix_len:
            feed(prefix_len, 0)

    out_sizes, seconds = [], []
    for i, n in enumerate(wanted):
        best = None
        for r in range(1 + max(0, repeats)):
            if (i or r) and budget_s - (time.perf_counter() - start) < (best or 0.0):
                break
            t = feed(n, prefix_len)
            restore()
            best = t if best is None else min(best, t)
        if best is None:
            break
        out_sizes.append(n)
        seconds.append(max(best, 1e-9))
    return out_sizes, seconds


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -I ov_worker.py SPEC_JSON (started by the drafter-type benchmark)", file=sys.stderr)
        return 2
    spec = json.loads(argv[0])
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything a library prints goes to stderr, never into the protocol
    sys.stdout = sys.stderr
    state = State(spec)
    return serve(sys.stdin, proto, state.handle)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
