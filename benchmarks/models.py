"""The models a benchmark runs: a random target and its 1-layer cut built on the spot, and the memory a model or a
cluster's models take (for pass planning)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


DTYPE_TAGS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def build_random_pair(root: Path, *, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
                      max_positions: int, deep_scale: float, seed: int) -> tuple[Path, Path]:
    """Save a random Qwen2-style target and its 1-layer cut (the same embeddings, first layer, norm and LM head) with
    the tests' tiny tokenizer into ``root``; return both folders. The target's later layers write only
    ``deep_scale`` of their output into the residual stream (their compute is unchanged), so the cut agrees with it
    on most tokens (α ≈ 1): a drafter whose acceptance is known, without downloading anything."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from testkit.tiny_models import build_tokenizer, save_tiny

    tokenizer = build_tokenizer(root / "tokenizer")
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
        eos_token_id=0, pad_token_id=1, bos_token_id=None, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for layer in target.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(deep_scale)
            layer.mlp.down_proj.weight.mul_(deep_scale)
    target_dir = save_tiny(target, tokenizer, root / "target")  # a fresh random LM head, shared with the cut
    cut_config = copy.deepcopy(config)
    cut_config.num_hidden_layers = 1
    if isinstance(getattr(cut_config, "layer_types", None), list):
        cut_config.layer_types = cut_config.layer_types[:1]
    assistant = AutoModelForCausalLM.from_config(cut_config)
    missing, _ = assistant.load_state_dict(target.state_dict(), strict=False)  # layers 1.. of the target are unused
    if missing:
        raise RuntimeError(f"the cut assistant lacks {missing}")
    assistant.generation_config = copy.deepcopy(target.generation_config)
    assistant_dir = root / "assistant"
    assistant.save_pretrained(assistant_dir)
    tokenizer.save_pretrained(assistant_dir)
    return target_dir, assistant_dir


def model_gib(path: str, dtype: str, fraction: float = 1.0) -> float:
    """Resident size of a model folder's weights loaded in ``dtype`` (from the safetensors sizes and the stored
    dtype); ``fraction`` for drafters that load part of a checkpoint."""
    folder = Path(path)
    stored = 2
    with contextlib.suppress(OSError, ValueError):
        cfg = json.loads((folder / "config.json").read_text())
        stored = DTYPE_BYTES.get(str(cfg.get("dtype") or cfg.get("torch_dtype")), 2)
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors")) or sum(
        f.stat().st_size for f in folder.glob("*.bin"))
    widen = 1.1 if DTYPE_BYTES[dtype] > stored else 1.0  # loading bf16 weights as fp32 peaks above the result
    return widen * fraction * size * DTYPE_BYTES[dtype] / stored / 2**30


def _sized_dtype(dtype: str) -> str:
    """``auto`` may become float32: budget memory for the larger."""
    return "float32" if dtype == "auto" else dtype


def cluster_models(cfg: dict[str, Any]) -> dict[str, float]:
    """GiB of the models a cluster of the loaded config ``cfg`` holds: the target in the verifier and the drafter's
    model (none for the model-free types; for early exit its first layers plus, roughly, the embeddings and LM head)."""
    from shared.llama_engine import gguf_path
    from shared.models import ModelLoadError
    from weights import resolve_model

    v, d = cfg["verifier"], cfg["drafter"]
    models: dict[str, float] = {}
    if v["backend"] == "llama_cpp":  # a GGUF target: llama.cpp maps the file as it is
        with contextlib.suppress(ModelLoadError, OSError):
            models["verifier"] = gguf_path(v["model"], "verifier.model").stat().st_size / 2**30
    if "verifier" not in models:
        models["verifier"] = model_gib(resolve_model(v["model"]), _sized_dtype(v["dtype"]))
    from drafter_node.types import drafter_spec

    if not cfg["launch"]["start_drafter"] or not drafter_spec(d["type"]).needs_model:
        return models
    if d["type"] == "gguf":  # llama.cpp maps the GGUF as it is, in its own tensor types
        with contextlib.suppress(ModelLoadError, OSError):
            models["drafter"] = gguf_path(d["model"]).stat().st_size / 2**30
            return models
    path = resolve_model(d.get("model") or v["model"])
    fraction = 1.0
    if d["type"] == "early_exit" and d.get("assistant_early_exit"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            layers = json.loads((Path(path) / "config.json").read_text())["num_hidden_layers"]
            fraction = min(1.0, d["assistant_early_exit"] / layers + 0.3)
    models["drafter"] = model_gib(path, _sized_dtype(d["dtype"]), fraction)
    return models
