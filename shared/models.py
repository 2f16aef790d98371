"""Model and tokenizer loading shared by both nodes.

``model:`` in a config may be a hub id, a local folder, or one of the named offline models of
:mod:`shared.registry` (installed from registry packages and converted once into a cache folder). Everything is
loaded through ``from_pretrained``, so tests with tiny saved models exercise the same path as real runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(RuntimeError):
    """A model or tokenizer that cannot be loaded; the message says which and why."""


def set_threads(threads: int) -> None:
    """Give this process its own thread budget (two nodes asking for all cores at once collapse)."""
    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # may only be set once, before any parallel work
        torch.set_num_interop_threads(max(1, threads))


def resolve_model(name: str, progress: Any = None) -> str:
    """Map a config's ``model`` value to something ``from_pretrained`` accepts, installing named models."""
    from shared import registry

    if registry.is_named_model(name):
        kwargs = {"progress": progress} if progress else {}
        return str(registry.ensure_model(name, **kwargs))
    return os.path.expanduser(name)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {path!r}: {exc}") from exc


def load_causal_lm(
    path: str, device: str = "cpu", dtype: str = "float32", max_memory: dict | None = None, config: Any = None
):
    """Load a causal LM for inference. ``device: auto`` spreads it over the GPUs with accelerate; ``config``
    replaces the checkpoint's (e.g. fewer layers: only their weights are read)."""
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
    if device != "auto":
        model.to(device)
    model.eval()
    return model


def input_device(model) -> torch.device:
    """Where input ids must go (the embedding's device when accelerate spread the model)."""
    return model.get_input_embeddings().weight.device


def tokenizer_id(tokenizer) -> str:
    """A fingerprint of the token ↔ id mapping: two tokenizers with the same id encode text identically."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode())
    return f"{type(tokenizer).__name__.removesuffix('Fast')}:{len(vocab)}:{digest.hexdigest()[:32]}"


def default_eos_ids(model, tokenizer) -> list[int]:
    """EOS ids from the model's generation config (what ``generate`` stops on), else the tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


def logits_vocab_size(model) -> int:
    return int(model.get_output_embeddings().weight.shape[0])
