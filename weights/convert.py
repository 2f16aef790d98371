"""Turning an assembled GGUF into an ordinary transformers folder (bf16 safetensors, generation config, tokenizer)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import pathlib
import time

from shared.named_models import RegistryError
from weights.progress import ProgressFn, default_progress, quiet_library_bars


def convert_gguf(
    gguf_path: pathlib.Path,
    out_dir: pathlib.Path,
    *,
    progress: ProgressFn = default_progress,
) -> None:
    """Convert a GGUF file into a bf16 safetensors folder (model, generation config and tokenizer).

    Loads with ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=NAME, dtype=torch.bfloat16)``, drops
    ``config.quantization_config``, builds a plain model with ``from_config`` in bf16, copies the weights with
    ``load_state_dict`` and saves it with ``save_pretrained``; the tokenizer is loaded from the same GGUF and
    saved next to it. ``out_dir`` must not hold a previous conversion (the caller clears it).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_library_bars()  # transformers' bars on a terminal; in a log, the lines below
    folder, name = str(gguf_path.parent), gguf_path.name
    t0 = time.monotonic()
    progress(f"loading {name} with transformers (dequantizing; this takes a while)")
    try:
        gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    except Exception as exc:
        raise RegistryError(
            f"transformers could not load {gguf_path} ({type(exc).__name__}: {exc}); check that the `gguf` "
            f"package is installed and that this transformers version supports the model's architecture"
        ) from exc
    progress(f"loaded GGUF in {time.monotonic() - t0:.1f}s; rebuilding as a plain bf16 model")
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state = gguf_model.state_dict()
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Tied output embeddings may be absent from one side; anything else missing is a real problem.
    tied = {k for k in missing if k.endswith("lm_head.weight") and getattr(config, "tie_word_embeddings", False)}
    if set(missing) - tied or unexpected:
        raise RegistryError(
            f"converting {name}: weights do not match the rebuilt model (missing {sorted(set(missing) - tied)}, "
            f"unexpected {sorted(unexpected)}); this transformers version maps this GGUF differently"
        )
    if tied:
        model.tie_weights()
    model.generation_config = gguf_model.generation_config
    model.eval()
    del gguf_model, state
    out_dir.mkdir(parents=True, exist_ok=True)
    t1 = time.monotonic()
    model.save_pretrained(str(out_dir), max_shard_size="100GB")
    del model
    progress(f"saved bf16 weights in {time.monotonic() - t1:.1f}s")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.save_pretrained(str(out_dir))
    del tokenizer
    _release_memory()  # the launcher runs on beside the nodes: give back the GB the conversion used
    progress(f"converted {name} in {time.monotonic() - t0:.1f}s")


def _release_memory() -> None:
    """Collect and hand freed heap pages back to the system (glibc keeps them otherwise)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
