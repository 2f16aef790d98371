"""The drafter-type conformance suite's tiny setups (tests/test_conformance.py runs the checks).

Every registered drafter type names a factory in its spec, ``DrafterSpec(conformance="module:function")``; the
factory gets an empty folder, builds there the tiny models its type needs (a target, a draft model, a checkpoint
with MTP layers, a second tokenizer, a single model file...) and returns a :class:`ConformanceSetup`: the
``drafter`` config section that runs the type on them, and the prompts that make it draft. The suite then checks,
for every type alike, greedy identity with transformers through real node processes, lossless sampling with its
negative control, and the config refusals. The bundled types' factories are below.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from drafter_node.spec import DrafterSpec
from testkit.tiny_models import (
    CORPUS,
    OTHER_CORPUS,
    build_bpe,
    build_gemma4_pair,
    build_model,
    build_small_vocab_tokenizer,
    build_tokenizer,
    word_tokenizer,
)
from testkit.tiny_mtp import build_mtp_model

#: The sampling check's default prompt (tests/sampling_check.py's ``PROMPT``).
SAMPLING_PROMPT = [2, 5, 7]


@dataclass(frozen=True)
class SamplingSetup:
    """The lossless-sampling check of a type: a sharpened target over build_small_vocab_tokenizer's 12 tokens (the
    check computes the exact joint of its first two tokens over that vocabulary) and a drafter section whose drafts
    really differ from the target (the accept-all negative control must fail)."""

    #: The target's folder (``verifier.model``).
    target: Path
    #: The ``drafter`` section, as in :attr:`ConformanceSetup.drafter`.
    drafter: dict[str, Any]
    #: Prompt of every sampled request (a repeating one for a type that drafts from the history).
    prompt: list[int] = field(default_factory=lambda: list(SAMPLING_PROMPT))
    #: ``verifier`` keys over the suite's defaults.
    verifier: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ConformanceSetup:
    """What the conformance suite needs to run one drafter type on tiny models."""

    #: The target's folder (``verifier.model``).
    target: Path
    #: The ``drafter`` section, laid over the suite's tiny defaults (float32, one thread, no profile): ``type``,
    #: ``model`` (a folder, a single model file, or None for a type without one) and whatever else the type needs
    #: (its own keys, ``num_draft_tokens``, ``overlap``). A plain dict: the factory fills it as the type reads it.
    drafter: dict[str, Any]
    #: Greedy prompts on which the type drafts, some tokens accepted and some rejected.
    prompts: list[list[int]]
    #: Tokens generated per greedy prompt.
    max_new_tokens: int = 24
    #: ``verifier`` keys over the suite's defaults.
    verifier: dict[str, Any] = field(default_factory=dict)
    #: The lossless-sampling check; required of a type that sends q (``DrafterSpec.sends_q``).
    sampling: SamplingSetup | None = None
    #: Whether the greedy prompts get some drafts accepted (the check then wants accepted and rejected ones). False
    #: only where the tiny drafter cannot agree with the target (``universal``'s random model over another tokenizer);
    #: drafts must still be made and rejected.
    drafts_accepted: bool = True
    #: The type's own keys that set a draft block's length: each must be bounded by the protocol's
    #: ``MAX_DRAFT_TOKENS`` (the common ``drafter.num_draft_tokens`` is checked for every type).
    block_keys: tuple[str, ...] = ()


Factory = Callable[[Path], ConformanceSetup]


class NoConformanceSetup(LookupError):
    """A registered type whose spec names no (loadable) conformance factory."""


def conformance_factory(spec: DrafterSpec) -> Factory:
    """The factory ``spec.conformance`` names; :class:`NoConformanceSetup` saying what to declare when it names
    none or one that does not exist."""
    where = f"drafter_node/type_specs/{spec.name}.py (the module drafter_node/types.py lists)"
    if spec.conformance is None:
        raise NoConformanceSetup(
            f"drafter type {spec.name!r} declares no conformance setup: add conformance=\"module:function\" to its "
            f"SPEC in {where}, naming a function (root: Path) -> testkit.conformance.ConformanceSetup that builds "
            "its tiny test models in root (docs/development.md, adding a drafter type)")
    module, sep, name = spec.conformance.partition(":")
    try:
        factory = getattr(importlib.import_module(module), name, None) if module and sep and name else None
    except ImportError as e:
        raise NoConformanceSetup(f"drafter type {spec.name!r}: conformance={spec.conformance!r}: {e}") from e
    if not callable(factory):
        raise NoConformanceSetup(f"drafter type {spec.name!r}: conformance={spec.conformance!r} in {where} must "
                                 "name a function as 'module:function'")
    return factory


# ------------------------------------------------------------------------------------------- shared models
# The same models (seeds, sizes) as the per-type tests used before the suite replaced their greedy and sampling
# checks (tests/conftest.py's tiny("llama") and sharp_pair).

#: Prompts for a drafter model (tests/test_greedy_e2e.py's).
PROMPTS = [[5, 17, 33, 2, 60], [100, 101, 7], [42] * 12 + [9, 8]]
#: A prompt that repeats itself, for types that draft from the token history.
REPEATING = [5, 17, 33, 2, 60, 5, 17, 33, 2, 61, 5, 17]
#: The same over the sampling vocabulary.
SAMPLING_REPEATING = [2, 5, 7, 2, 5, 7, 2, 5]


def _llama_target(root: Path) -> Path:
    """tests/conftest.py's ``tiny("llama")``: two layers, seed 1, the 160-token BPE."""
    build_tokenizer(root / "tok")
    return build_model(root / "target", "llama", root / "tok", seed=1)


def _sharp_tokenizer(root: Path) -> Path:
    build_small_vocab_tokenizer(root / "sharp-tok")
    return root / "sharp-tok"


def _sharp_target(root: Path) -> Path:
    """tests/conftest.py's ``sharp_pair`` target."""
    return build_model(root / "sharp-target", "llama", _sharp_tokenizer(root), seed=11, sharpen=1.2)


# ------------------------------------------------------------------------------------------- the bundled types


def first_layer(target: Path, folder: Path) -> Path:
    """The target's first layer alone, saved as a model of its own (agrees with the target on some tokens)."""
    config = AutoConfig.from_pretrained(target)
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None):  # Qwen2 and newer configs list one attention kind per layer
        config.layer_types = config.layer_types[:1]
    AutoModelForCausalLM.from_pretrained(target, config=config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(target).save_pretrained(folder)
    return folder


def assistant(root: Path) -> ConformanceSetup:
    """The tiny Llama's first layer as the drafter (some drafts accepted, most rejected); the sharp pair for
    sampling."""
    target = _llama_target(root)
    drafter = first_layer(target, root / "drafter")
    sharp_drafter = build_model(root / "sharp-drafter", "llama", _sharp_tokenizer(root), seed=12, layers=1,
                                sharpen=1.2)
    return ConformanceSetup(
        target=target, drafter={"type": "assistant", "model": str(drafter), "num_draft_tokens": 3, "overlap": True},
        prompts=PROMPTS, max_new_tokens=40,
        sampling=SamplingSetup(_sharp_target(root), {"type": "assistant", "model": str(sharp_drafter),
                                                     "num_draft_tokens": 3, "q_top_k": 0}))


def prompt_lookup(root: Path) -> ConformanceSetup:
    """Lookups in a repeating prompt (the tiny Llama falls into loops that lookups predict)."""
    return ConformanceSetup(
        target=_llama_target(root),
        drafter={"type": "prompt_lookup", "model": None, "prompt_lookup_num_tokens": 4, "overlap": True},
        prompts=[REPEATING, [9, 8, 7]], max_new_tokens=40, block_keys=("prompt_lookup_num_tokens",),
        sampling=SamplingSetup(_sharp_target(root), {"type": "prompt_lookup", "model": None,
                                                     "prompt_lookup_num_tokens": 3}, prompt=SAMPLING_REPEATING))


def early_exit(root: Path) -> ConformanceSetup:
    """The first of the tiny Llama's two layers; for sampling a six-layer target whose first layer alone predicts
    clearly differently (so the control can fail)."""
    deep = build_model(root / "deep-target", "llama", _sharp_tokenizer(root), seed=21, layers=6, sharpen=1.2)
    return ConformanceSetup(
        target=_llama_target(root),
        drafter={"type": "early_exit", "model": None, "assistant_early_exit": 1, "num_draft_tokens": 3,
                 "overlap": True},
        prompts=PROMPTS[:2], max_new_tokens=30,
        sampling=SamplingSetup(deep, {"type": "early_exit", "model": None, "assistant_early_exit": 1,
                                      "num_draft_tokens": 2, "q_top_k": 0}))


def mtp(root: Path) -> ConformanceSetup:
    """A tiny DeepSeek-V3 target with two random MTP layers in its checkpoint."""
    build_tokenizer(root / "tok")
    target = build_mtp_model(root / "mtp-target", "deepseek_v3", root / "tok", seed=3, mtp_layers=2)
    sharp = build_mtp_model(root / "sharp-mtp", "deepseek_v3", _sharp_tokenizer(root), seed=31, mtp_layers=2,
                            sharpen=1.5)
    return ConformanceSetup(
        target=target, drafter={"type": "mtp", "model": None, "overlap": True},
        prompts=[[5, 17, 33, 2, 60], [100, 101, 7], [42]], max_new_tokens=24,
        sampling=SamplingSetup(sharp, {"type": "mtp", "model": None, "q_top_k": 0}))


def mtp_drafter(root: Path) -> ConformanceSetup:
    """A tiny Gemma 4 target and its assistant; prompts of one token (the drafter waits for the first commit's
    state) and longer than the sliding window of 8."""
    build_tokenizer(root / "tok")
    target, assistant_model = build_gemma4_pair(root / "gemma4", root / "tok")
    sharp_target, sharp_assistant = build_gemma4_pair(root / "sharp-gemma4", _sharp_tokenizer(root), seed=11,
                                                      sharpen=1.5)
    return ConformanceSetup(
        target=target,
        drafter={"type": "mtp_drafter", "model": str(assistant_model), "num_draft_tokens": 3, "overlap": True},
        prompts=[[5, 17, 33, 2, 60], [100, 101, 7], [9], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]], max_new_tokens=30,
        sampling=SamplingSetup(sharp_target, {"type": "mtp_drafter", "model": str(sharp_assistant),
                                              "num_draft_tokens": 2, "q_top_k": 0}))


def universal(root: Path) -> ConformanceSetup:
    """A Qwen2 drafter whose BPE has other merges and ids than the target's; for sampling a drafter over the
    target's words in another order, two of them missing."""
    build_bpe(root / "tok_target", 330, CORPUS, ["<eos>", "<pad>"])
    build_bpe(root / "tok_other", 420, OTHER_CORPUS, ["<pad>", "<s>", "<eos>"])  # different merges and ids
    target = build_model(root / "target", "llama", root / "tok_target", seed=1)
    other = build_model(root / "other", "qwen2", root / "tok_other", seed=3, layers=1)
    encode = PreTrainedTokenizerFast.from_pretrained(target)
    prompts = [encode(text, add_special_tokens=False)["input_ids"]
               for text in ("def add(a, b):\n    return", "for i in range(10):\n", "the quick brown fox")]
    return ConformanceSetup(
        target=target, drafter={"type": "universal", "model": str(other), "num_draft_tokens": 4, "overlap": True},
        prompts=prompts, max_new_tokens=30, drafts_accepted=False,
        sampling=SamplingSetup(_sharp_target(root), {"type": "universal", "model": str(build_word_drafter(root)),
                                                     "num_draft_tokens": 2, "q_top_k": 0}))


def build_word_drafter(root: Path) -> Path:
    """A drafter over the sampling target's words ordered differently, lacking two of them (w0, w1)."""
    words = ["<pad>", "<eos>", *[f"w{i}" for i in range(9, 1, -1)], "zz", "yy"]  # ids all different
    word_tokenizer(root / "word-tok", words)
    return build_model(root / "word-drafter", "llama", root / "word-tok", seed=12, layers=1, sharpen=1.2)


def suffix(root: Path) -> ConformanceSetup:
    """An eager setting (no probability floor, long proposals) so that some drafts are rejected."""
    return ConformanceSetup(
        target=_llama_target(root),
        drafter={"type": "suffix", "model": None, "suffix_num_draft_tokens": 6, "suffix_min_token_prob": 0.0,
                 "suffix_max_spec_factor": 4.0, "overlap": True},
        prompts=[REPEATING, [9, 8, 7], REPEATING[::-1]], max_new_tokens=40, block_keys=("suffix_num_draft_tokens",),
        sampling=SamplingSetup(_sharp_target(root), {"type": "suffix", "model": None, "suffix_num_draft_tokens": 3},
                               prompt=SAMPLING_REPEATING))
