"""``early_exit`` drafter (self-speculative decoding, LayerSkip): the target's own first E layers, its final norm
and its LM head, loaded into the drafter's process and device.

The drafter builds the target's architecture with ``E`` layers and loads the checkpoint into it, so only those
layers' weights are read (a fraction of the target's memory); drafting is then the assistant's model-based
drafting, with its own KV cache, rollback and multi-outcome pre-drafting. Works for any decoder whose config names
its depth (Llama/Qwen2 ``num_hidden_layers``, GPT-2 ``n_layer``) — no use of transformers' early-exit path.
"""

from __future__ import annotations

from typing import Any

from transformers import AutoConfig

from drafter_node.assistant import AssistantDrafter


class EarlyExitError(ValueError):
    """``assistant_early_exit`` does not fit the target checkpoint."""


def depth_key(config) -> str:
    for key in ("num_hidden_layers", "n_layer"):
        if isinstance(getattr(config, key, None), int):
            return key
    raise EarlyExitError(f"{type(config).__name__} names no layer count (num_hidden_layers / n_layer)")


def check_exit_layer(config, exit_layer: Any) -> int:
    """The target's layer count (from its config); raises :class:`EarlyExitError` unless 1 ≤ exit_layer ≤ layers − 1."""
    layers = getattr(config, depth_key(config))
    if isinstance(exit_layer, bool) or not isinstance(exit_layer, int) or not 1 <= exit_layer <= layers - 1:
        raise EarlyExitError(
            f"drafter.assistant_early_exit: must be an integer in 1..{layers - 1} for this target "
            f"({layers} layers), got {exit_layer!r}"
        )
    return layers


def exit_config(path: str, exit_layer: int):
    """The target's config (from the checkpoint at ``path``) cut to its first ``exit_layer`` layers."""
    config = AutoConfig.from_pretrained(path)
    check_exit_layer(config, exit_layer)
    setattr(config, depth_key(config), exit_layer)
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:exit_layer]
    return config


class EarlyExitDrafter(AssistantDrafter):
    """Built as the assistant is, with ``own`` an ``EarlyExitSettings`` (the exit layer; not imported here: its
    spec module imports this one for its check)."""

    type_name = "early_exit"

    def model_config(self, path: str, own: Any):
        return exit_config(path, own.assistant_early_exit)
