"""Tiny random hybrid and state-space models (the cache kinds :mod:`shared.kv` rolls back by snapshot and re-feed):
Qwen3-Next (gated delta net + full attention, mixture of experts), Mamba2 (pure SSM), Falcon-H1 (SSM and attention
in every layer) and LFM2 (short convolutions + attention). Built from configs on CPU, saved with a tokenizer and
loaded with ``from_pretrained`` like every other test model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from testkit.tiny_models import save_tiny

#: The families covered, with the kind of state each one's cache holds.
HYBRID_FAMILIES = {
    "qwen3_next": "gated delta net (conv + recurrent state) and full attention layers",
    "mamba2": "Mamba2 SSM layers only (conv + recurrent state)",
    "falcon_h1": "an SSM and attention in every layer",
    "lfm2": "short convolution (conv state) and full attention layers",
}


def hybrid_config(family: str, vocab_size: int, eos_token_id: int = 0):
    """A tiny config of ``family`` (one of :data:`HYBRID_FAMILIES`)."""
    common = dict(vocab_size=vocab_size, eos_token_id=eos_token_id, pad_token_id=1, bos_token_id=None,
                  tie_word_embeddings=False)
    attention = dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    if family == "qwen3_next":
        return AutoConfig.for_model(
            "qwen3_next", num_hidden_layers=4, full_attention_interval=2, linear_num_value_heads=4,
            linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32, **attention, **common)
    if family == "mamba2":
        return AutoConfig.for_model("mamba2", hidden_size=64, num_hidden_layers=2, state_size=16, expand=2, n_groups=1,
                                    num_heads=8, head_dim=16, conv_kernel=4, **common)
    if family == "falcon_h1":
        return AutoConfig.for_model("falcon_h1", num_hidden_layers=2, mamba_d_state=16, mamba_n_heads=8,
                                    mamba_d_head=16, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2,
                                    mamba_d_ssm=128, **attention, **common)
    if family == "lfm2":
        return AutoConfig.for_model("lfm2", num_hidden_layers=4, conv_L_cache=3,
                                    layer_types=["conv", "full_attention", "conv", "full_attention"],
                                    **attention, **common)
    raise ValueError(f"unknown hybrid family {family!r} (known: {', '.join(HYBRID_FAMILIES)})")


def build_hybrid(folder: Path, family: str, tokenizer_folder: Path, seed: int, sharpen: float = 1.0) -> Path:
    """Save a random tiny ``family`` model with the tokenizer of ``tokenizer_folder`` into ``folder``."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_folder)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hybrid_config(family, len(tokenizer)))
    return save_tiny(model, tokenizer, folder, sharpen)


def perturbed_copy(source: Path, folder: Path, noise: float, seed: int) -> Path:
    """``source`` with Gaussian noise of ``noise`` × its scale added to the LM head: a drafter that agrees with the
    target on some tokens and not on others (so a run sees drafts accepted and rejected)."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.add_(torch.randn(head.shape, generator=generator) * noise * head.std())
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
