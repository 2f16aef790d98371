"""Tiny random models and a tokenizer trained on the spot, saved to folders and loaded with ``from_pretrained`` —
the same path real models take, at a size that runs in milliseconds on one thread.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i)\n",
    "the quick brown fox jumps over the lazy dog",
    "class Node:\n    def __init__(self, value):\n        self.value = value\n",
    "import numpy as np\nx = np.zeros((3, 4))\n",
    "while True:\n    break\n",
    "Speculative decoding drafts tokens with a small model and verifies them with a large one.",
] * 20

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer(folder: Path, vocab_size: int = 160, corpus: list[str] | None = None) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer and save it (with an EOS token and a chat template) to ``folder``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<eos>", "<pad>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus or CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def model_config(arch: str, vocab_size: int, layers: int = 2, eos_token_id: int = 0):
    common = dict(vocab_size=vocab_size, eos_token_id=eos_token_id, pad_token_id=1, bos_token_id=None)
    if arch == "llama":
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=512, **common)
    if arch == "qwen2":
        return Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=512, **common)
    if arch == "gpt2":
        return GPT2Config(n_embd=64, n_layer=layers, n_head=4, n_positions=512, **common)
    raise ValueError(arch)


def build_model(folder: Path, arch: str, tokenizer_folder: Path, seed: int, layers: int = 2,
                sharpen: float = 1.0, vocab_size: int | None = None) -> Path:
    """Save a random model of ``arch`` with the tokenizer of ``tokenizer_folder`` into ``folder``.

    ``sharpen`` scales the LM head so the next-token distribution is peaked (useful for sampling tests)."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_folder)
    torch.manual_seed(seed)
    config = model_config(arch, vocab_size or len(tokenizer), layers)
    model = AutoModelForCausalLM.from_config(config)
    model.config.tie_word_embeddings = False
    return save_tiny(model, tokenizer, folder, sharpen, eos_token_id=config.eos_token_id)


def save_tiny(model, tokenizer, folder: Path, sharpen: float = 1.0, eos_token_id: int = 0) -> Path:
    """Give ``model`` a fresh random LM head scaled by ``sharpen`` (peaked next-token distributions for sampling
    tests), set its end/pad ids and save it with ``tokenizer`` into ``folder``. The head is fresh because tied tiny
    models (GPT-2) otherwise just repeat their input token, and a target and a "random" drafter would then agree
    on everything."""
    with torch.no_grad():
        head = model.get_output_embeddings()
        head.weight = torch.nn.Parameter(torch.randn_like(head.weight) * 0.2 * sharpen)
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = 1
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def reference_greedy(folder: Path, prompt: list[int], max_new_tokens: int, eos: list[int] | None = None) -> list[int]:
    """transformers' own greedy ``generate`` on the target alone: the ground truth."""
    model = _reference_model(str(folder))
    config = copy.deepcopy(model.generation_config)
    # An empty list, not None: None would fall back to the checkpoint's own EOS.
    config.eos_token_id = list(eos) if eos else []
    config.pad_token_id = 1
    config.do_sample = False
    config.max_new_tokens = max_new_tokens
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt):].tolist()


@functools.lru_cache(maxsize=8)
def _reference_model(folder: str):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def build_small_vocab_tokenizer(folder: Path, words: int = 10) -> PreTrainedTokenizerFast:
    """A word-level tokenizer with ``words`` + 2 tokens, for sampling tests on a small, sharpened vocabulary."""
    vocab = {"<eos>": 0, "<pad>": 1, **{f"w{i}": i + 2 for i in range(words)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    fast.save_pretrained(folder)
    return fast


OTHER_CORPUS = [
    "def mul(x, y):\n    return x * y\n",
    "numbers = [n * n for n in range(20) if n % 2]\n",
    "a lazy dog sleeps while the quick fox runs around the house",
    "class Tree:\n    def __init__(self, left, right):\n        self.left = left\n",
    "Small models draft, large models verify: speculative decoding in a nutshell.",
] * 20

def build_bpe(folder: Path, vocab_size: int, corpus: list[str], specials: list[str]) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on ``corpus``; ``specials`` first (their order shifts every other id)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>",
                                   pad_token="<pad>" if "<pad>" in specials else None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def word_tokenizer(folder: Path, words: list[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``words`` in that order (ids = positions), saved to ``folder``."""
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    fast.save_pretrained(folder)
    return fast


def gemma4_text_config(vocab_size: int, hidden: int, layers: list[str], sliding_window: int = 8, **extra):
    """A tiny Gemma 4 text config (one head size for both attention types, so an assistant can read either)."""
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=len(layers),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=16, layer_types=list(layers),
        sliding_window=sliding_window, max_position_embeddings=512, eos_token_id=0, pad_token_id=1,
        bos_token_id=None, tie_word_embeddings=False, **extra,
    )


def build_gemma4_pair(root: Path, tokenizer_folder: Path, seed: int = 1, sharpen: float = 1.0) -> tuple[Path, Path]:
    """A tiny Gemma 4 target (sliding + full layers, the last two sharing K/V, per-layer inputs as in E2B) and a tiny
    ``Gemma4AssistantForCausalLM`` for it, saved to ``root/gemma4-target`` and ``root/gemma4-assistant``."""
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_folder)
    vocab = len(tokenizer)
    torch.manual_seed(seed)
    config = gemma4_text_config(vocab, 64, ["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
                                hidden_size_per_layer_input=8, vocab_size_per_layer_input=vocab)
    target = AutoModelForCausalLM.from_config(config)
    assistant_text = gemma4_text_config(vocab, 32, ["sliding_attention", "full_attention"],
                                        hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)
    assistant = Gemma4AssistantForCausalLM(
        Gemma4AssistantConfig(text_config=assistant_text, backbone_hidden_size=64, tie_word_embeddings=False)
    )
    folders = root / "gemma4-target", root / "gemma4-assistant"
    for model, folder in zip((target, assistant), folders):
        save_tiny(model, tokenizer, folder, sharpen)
    return folders
