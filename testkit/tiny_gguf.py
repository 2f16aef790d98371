"""A tiny Qwen2 model written as a GGUF file, for tests of the ``gguf`` drafter type (llama.cpp).

:func:`write_qwen2_gguf` takes a tiny Qwen2 folder built by :mod:`testkit.tiny_models` (random weights, a byte-level
BPE tokenizer trained on the spot) and writes the same weights in float32 as a GGUF that llama.cpp loads: the
tensor names and metadata llama.cpp's own converter writes for ``qwen2``, and the tokenizer as a ``gpt2`` BPE vocabulary
(token strings in id order, the merges, control tokens marked). llama.cpp then computes what transformers computes
on the folder, up to float rounding, which the tests check before they rely on it.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, PreTrainedTokenizerFast

# transformers' Qwen2 parameter names → llama.cpp's (``{i}``: the layer)
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name of a transformers Qwen2 parameter."""
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name]
    _, _, index, rest = hf_name.split(".", 3)  # model.layers.{i}.rest
    return f"blk.{index}.{_LAYER_NAMES[rest]}"


def write_qwen2_gguf(folder: Path, out: Path, vocab_tokens: list[str] | None = None) -> Path:
    """Write the tiny Qwen2 model in ``folder`` as the GGUF file ``out`` (float32 tensors).

    ``vocab_tokens``: token strings to write instead of the folder tokenizer's (a test of the vocabulary check
    writes a vocabulary that does not map onto the target's)."""
    config = AutoConfig.from_pretrained(folder)
    if config.model_type != "qwen2":
        raise ValueError(f"write_qwen2_gguf writes qwen2 models, not {config.model_type}")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    tensors = load_file(str(Path(folder) / "model.safetensors"))
    if "lm_head.weight" not in tensors:  # tied head: llama.cpp reuses token_embd when output is absent
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]

    writer = gguf.GGUFWriter(str(out), "qwen2")
    writer.add_name(Path(folder).name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    vocab = tokenizer.get_vocab()
    tokens = vocab_tokens or [tok for tok, _ in sorted(vocab.items(), key=lambda item: item[1])]
    # llama.cpp wants one token per embedding row: pad a head wider than the vocabulary, drop tokens past it
    tokens = (tokens + [f"[PAD{i}]" for i in range(len(tokens), config.vocab_size)])[: config.vocab_size]
    special = set(tokenizer.all_special_tokens)
    types = [gguf.TokenType.CONTROL if tok in special else gguf.TokenType.NORMAL for tok in tokens]
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model.get("merges", [])]
    if not merges:  # a byte-only vocabulary has none, but llama.cpp's BPE loader requires the key (never used:
        merges = ["a b"]  # pipespec sends the drafter token ids, it never tokenizes text)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(int(config.eos_token_id if config.eos_token_id is not None else tokenizer.eos_token_id))
    writer.add_pad_token_id(int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0))
    writer.add_add_bos_token(False)

    for name, tensor in tensors.items():
        writer.add_tensor(gguf_name(name), tensor.to(torch.float32).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def conformance(root: Path):
    """The ``gguf`` type's tiny setup for tests/test_conformance.py: a tiny Qwen2 target and its first layer written
    as GGUF (some drafts accepted, some rejected); for sampling a sharpened Qwen2 target over the 12-token
    vocabulary and a clearly different one-layer drafter, as GGUF."""
    from testkit.conformance import PROMPTS, ConformanceSetup, SamplingSetup, first_layer
    from testkit.tiny_models import build_model, build_small_vocab_tokenizer, build_tokenizer

    build_tokenizer(root / "tok")
    target = build_model(root / "target", "qwen2", root / "tok", seed=1)
    drafter = write_qwen2_gguf(first_layer(target, root / "first-layer"), root / "drafter.gguf")
    build_small_vocab_tokenizer(root / "sharp-tok")
    sharp_target = build_model(root / "sharp-target", "qwen2", root / "sharp-tok", seed=11, sharpen=1.2)
    sharp_drafter = build_model(root / "sharp-drafter", "qwen2", root / "sharp-tok", seed=12, layers=1, sharpen=1.2)
    return ConformanceSetup(
        target=target, drafter={"type": "gguf", "model": str(drafter), "num_draft_tokens": 3, "overlap": True},
        prompts=PROMPTS, max_new_tokens=40,
        sampling=SamplingSetup(sharp_target, {"type": "gguf", "model": str(write_qwen2_gguf(
            sharp_drafter, root / "sharp-drafter.gguf")), "num_draft_tokens": 3, "q_top_k": 0}))
