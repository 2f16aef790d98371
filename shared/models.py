"""Model and tokenizer loading shared by both nodes.

``model:`` in a config may be a hub id, a local folder, or one of the named offline models of
:mod:`shared.named_models` (installed by the launcher, with the ``weights`` package, before it starts the nodes; the
nodes only look their folder up). Everything is
loaded through ``from_pretrained``, so tests with tiny saved models exercise the same path as real runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from shared.model_facts import default_eos_ids, logits_vocab_size, model_dtype  # noqa: F401 - their old home

log = logging.getLogger("pipespec.models")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: ``dtype: auto``: the fastest dtype for the shapes a node runs, measured (see :func:`load_causal_lm`).
AUTO = "auto"


class ModelLoadError(RuntimeError):
    """A model or tokenizer that cannot be loaded; the message says which and why."""


@dataclass
class ProfileSpec:
    """What a node measures of its model at start-up: forward sizes (new tokens, or pre-draft rows), at which thread
    counts, within how many seconds (0: no profile)."""

    threads: list[int]
    sizes: list[int]
    budget_s: float
    variant: str = ""  # tells apart models built differently from one checkpoint (early_exit: the cut target)
    role: str = "drafter"  # verifier: dtype auto compares seconds per committed token (costs.verify_score)


@dataclass
class ThreadPlan:
    """A node's torch thread counts: ``share`` while the other node computes too, ``full`` while it idles.

    ``threads: N`` gives N for both. ``threads: auto`` on a CPU gives every core (``full``) and, when both nodes are
    on this machine's CPU, half of them (``share``), so the two never oversubscribe the cores while both work."""

    share: int
    full: int

    @classmethod
    def for_node(cls, threads: int | str, device: str, other_device: str) -> ThreadPlan:
        """The plan of a node whose section says ``threads`` and ``device``; ``other_device``: the other node's."""
        if threads != AUTO:
            return cls(int(threads), int(threads))
        cores = available_cores()
        both_on_cpu = device == "cpu" and other_device == "cpu"
        share = max(1, cores // 2) if both_on_cpu else cores
        return cls(share, cores)

    def counts(self) -> list[int]:
        return sorted({self.share, self.full})


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def heuristic_dtype(device: str) -> str:
    """``dtype: auto`` without a measurement: CUDA bf16 where supported, else fp16; MPS fp16; a CPU bf16 only with
    native bf16 arithmetic (avx512_bf16 or AMX), else fp32 (emulated bf16 is slower there for multi-token forwards)."""
    if device.startswith("cuda") or device == "auto":
        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float16"
    if device == "mps":
        return "float16"
    from shared.costs.hardware import hardware_flags

    flags = hardware_flags()
    return "bfloat16" if flags.get("avx512_bf16") or flags.get("amx") else "float32"


def concrete_dtype(dtype: str, device: str) -> str:
    """A config's dtype with ``auto`` resolved by :func:`heuristic_dtype` (for models that cannot be profiled)."""
    return heuristic_dtype(device) if dtype == AUTO else dtype


def profile_sizes(max_draft_tokens: int) -> list[int]:
    """Forward sizes both nodes measure: 1 .. ``drafter.max_draft_tokens`` + 1 new tokens (verifier) or rows
    (drafter), on the ladder 1, 2, 3, 4, 6, 8, 12, … (the curve interpolates between them)."""
    from shared.costs.measure import sizes_up_to

    return sizes_up_to(min(max_draft_tokens, 64) + 1)


def profile_node(model, source: str, device: str, spec: ProfileSpec, role: str):
    """The node's cost profile of ``model`` (measured within ``spec.budget_s``, or read from the disk cache)."""
    from shared.costs.measure import load_or_measure

    def progress(line: str) -> None:
        log.info("%s: %s", role, line)

    profile = load_or_measure(model, resolve_model(source), device, model_dtype(model), spec.threads, spec.sizes,
                              spec.budget_s, progress=progress, variant=spec.variant)
    scores = getattr(model, DTYPE_SCORES_ATTR, None)
    if profile is not None and scores:  # dtype auto's comparison, so the node can say why it runs in this dtype
        profile.candidates = dict(scores)
    return profile


def set_threads(threads: int) -> None:
    """Give this process its own thread budget (two nodes asking for all cores at once collapse)."""
    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # may only be set once, before any parallel work
        torch.set_num_interop_threads(max(1, threads))


def resolve_model(name: str) -> str:
    """Map a config's ``model`` value to something ``from_pretrained`` accepts: a named model's converted folder
    (installed beforehand: the launcher runs ``weights.ensure_model``), else the folder or hub id as given."""
    from shared.named_models import installed_folder, is_named_model, model_dir

    if is_named_model(name):
        folder = installed_folder(name)
        if folder is None:
            raise ModelLoadError(f"named model {name!r} is not installed in {model_dir(name)}: run `python -m "
                                 f"weights {name}` (the launcher installs named models before it starts the nodes)")
        return str(folder)
    return os.path.expanduser(name)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {path!r}: {exc}") from exc


def load_causal_lm(
    path: str, device: str = "cpu", dtype: str = "float32", max_memory: dict | None = None, config: Any = None,
    profile: ProfileSpec | None = None,
):
    """Load a causal LM for inference. ``device: auto`` spreads it over the GPUs with accelerate; ``config``
    replaces the checkpoint's (e.g. fewer layers: only their weights are read).

    ``dtype: auto`` with a ``profile`` spec on a CPU measures float32 and bfloat16 for the spec's shapes and keeps
    the faster (both measurements are cached on disk, so a second start loads only the winner); without a spec, or
    on a GPU, it takes :func:`heuristic_dtype`. The choice is logged."""
    if dtype == AUTO:
        if profile is not None and profile.budget_s > 0 and device == "cpu":
            from shared.costs.curve import verify_score
            from shared.costs.dtype_choice import resolve_auto_dtype
            from shared.costs.measure import measuring_alone

            verifier = profile.role == "verifier"

            def load(name: str):
                return load_causal_lm(path, device, name, max_memory, config)

            probe = probe_config(path, config)

            def load_probe(name: str):  # the candidates are compared on a cut model: one full load, the winner's
                return load_causal_lm(path, device, name, max_memory, probe)

            def progress(line: str) -> None:
                log.info("dtype auto: %s", line)

            with measuring_alone(device):  # load and measure while no other node on this machine measures
                model, prof = resolve_auto_dtype(load, path, device, profile.threads, profile.sizes,
                                                 profile.budget_s, progress=progress, variant=profile.variant,
                                                 score=verify_score if verifier else None,
                                                 load_probe=load_probe if probe is not None else None)
            log.info("dtype auto: %s chose %s (scores %s)", path, prof.dtype, prof.candidates)
            setattr(model, DTYPE_SCORES_ATTR, dict(prof.candidates))  # profile_node puts them in the node's profile
            return model
        dtype = heuristic_dtype(device)
        log.info("dtype auto: %s on %s -> %s", path, device, dtype)
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": DTYPES[dtype]}
    if config is not None:
        kwargs["config"] = config
    if device == "auto":
        kwargs["device_map"] = "auto"
        if max_memory:
            kwargs["max_memory"] = max_memory
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except Exception as exc:
        raise ModelLoadError(f"cannot load the model {path!r}: {exc}") from exc
    from shared.kv import rollback_problem

    if (problem := rollback_problem(model.config)) is not None:  # at load, not at the first rejected draft
        raise ModelLoadError(f"cannot serve the model {path!r}: {problem}")
    if device != "auto":
        model.to(device)
    model.eval()
    return model


#: The model attribute where :func:`load_causal_lm` leaves ``dtype: auto``'s scores (dtype -> seconds per token).
DTYPE_SCORES_ATTR = "_pipespec_dtype_scores"
#: ``dtype: auto`` compares its candidates on the model cut to 1/PROBE_DEPTH_DIVISOR of its layers (at least one):
#: the embeddings, the head and some layers of each, so only the winner is ever loaded whole (peak memory).
PROBE_DEPTH_DIVISOR = 4


def probe_config(path: str, config: Any = None):
    """The config of ``path`` (or ``config``) cut to 1/PROBE_DEPTH_DIVISOR of its layers; None when it names no
    layer count or is too shallow to cut (the candidates are then compared on the whole model)."""
    import copy

    from transformers import AutoConfig

    try:
        cut = copy.deepcopy(config) if config is not None else AutoConfig.from_pretrained(path)
    except Exception:  # no readable config: compare on the whole model, which reports its own error
        return None
    key = next((k for k in ("num_hidden_layers", "n_layer") if isinstance(getattr(cut, k, None), int)), None)
    if key is None or getattr(cut, key) < PROBE_DEPTH_DIVISOR:
        return None
    depth = getattr(cut, key) // PROBE_DEPTH_DIVISOR
    setattr(cut, key, depth)
    if isinstance(getattr(cut, "layer_types", None), list):
        cut.layer_types = cut.layer_types[:depth]
    return cut


def tokenizer_id(tokenizer) -> str:
    """A fingerprint of the token ↔ id mapping: two tokenizers with the same id encode text identically."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode())
    return f"{type(tokenizer).__name__.removesuffix('Fast')}:{len(vocab)}:{digest.hexdigest()[:32]}"


def vocab_fingerprint(tokens: list[str]) -> str:
    """A fingerprint of a vocabulary's token strings in id order, whatever holds it (a transformers tokenizer's
    vocabulary, a GGUF file's token list): two vocabularies with one fingerprint map every token to the same id.
    Trailing ``[PAD{id}]`` entries (a head padded wider than the vocabulary, as GGUF converters write it) are left
    out, so a GGUF and the tokenizer it was converted from agree."""
    end = len(tokens)
    while end and tokens[end - 1] == f"[PAD{end - 1}]":
        end -= 1
    digest = hashlib.sha256(json.dumps(tokens[:end], ensure_ascii=False).encode())
    return f"vocab:{end}:{digest.hexdigest()[:32]}"


def vocab_tokens(tokenizer) -> list[str]:
    """A transformers tokenizer's token strings in id order (ids missing from its vocabulary as ``[PAD{id}]``)."""
    by_id = {i: tok for tok, i in tokenizer.get_vocab().items()}
    return [by_id.get(i, f"[PAD{i}]") for i in range(max(by_id, default=-1) + 1)]


def _claimed_count(fingerprint: Any, available: int) -> int | None:
    """The token count a :func:`vocab_fingerprint` claims, where it is one of 1 .. ``available`` (ASCII digits only:
    ``str.isdigit`` also takes ``²``, which ``int`` refuses), else None."""
    if not isinstance(fingerprint, str) or not fingerprint.startswith("vocab:"):
        return None
    count = fingerprint.split(":", 2)[1]
    if not (count.isascii() and count.isdigit()) or len(count) > 9 or not 0 < int(count) <= available:
        return None
    return int(count)


def vocab_prefix_matches(fingerprint: Any, tokens: list[str] | VocabPrefixes) -> bool:
    """Whether a drafter's :func:`vocab_fingerprint` is that of the first n of ``tokens`` (the target's, in id
    order): every id the drafter can produce then means the target's token (a target with more tokens, such as
    added special tokens, is fine; the drafter never proposes those). A :class:`VocabPrefixes` answers from the
    fingerprints it computed before."""
    if isinstance(tokens, VocabPrefixes):
        return tokens.matches(fingerprint)
    count = _claimed_count(fingerprint, len(tokens))
    return count is not None and vocab_fingerprint(tokens[:count]) == fingerprint


class VocabPrefixes:
    """A target's token list with the fingerprints of its prefixes computed once each: the whole list's when made
    (at start-up, off the event loop), and each other length a drafter claims the first time it is claimed (at most
    ``keep`` remembered), so a hello does not hash the whole vocabulary on the loop again."""

    def __init__(self, tokens: list[str], keep: int = 8):
        self.tokens = tokens
        self.keep = keep
        whole = vocab_fingerprint(tokens)
        self._known: dict[int, str] = {int(whole.split(":")[1]): whole}

    def __len__(self) -> int:
        return len(self.tokens)

    def matches(self, fingerprint: Any) -> bool:
        count = _claimed_count(fingerprint, len(self.tokens))
        if count is None:
            return False
        known = self._known.get(count)
        if known is None:
            known = vocab_fingerprint(self.tokens[:count])
            if len(self._known) >= self.keep:
                self._known.pop(next(iter(self._known)))
            self._known[count] = known
        return known == fingerprint
