"""Facts about a loaded transformers model that a target, a node's hello and the profiles read: its dtype, the
columns of its logits, the end tokens ``generate`` stops on. Import-light (torch only), so the target seam
(:mod:`shared.target_torch`) and the cost measurements can use them without importing the loaders."""

from __future__ import annotations

from typing import Any


def model_dtype(model: Any) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def logits_vocab_size(model: Any) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


def default_eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """EOS ids from the model's generation config (what ``generate`` stops on), else the tokenizer's (None: no
    tokenizer, the generation config's only)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]
