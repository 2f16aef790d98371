"""``early_exit``: the target checkpoint's own first E layers draft (``drafter_node/early_exit.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from drafter_node.spec import DrafterSpec, LocalFolder, positive_int
from shared.settings import setting


@dataclass(frozen=True)
class EarlyExitSettings:
    """``early_exit``'s own ``drafter`` keys."""

    assistant_early_exit: Any = setting(None, "Target layers the drafter runs (1..layers-1); required.",
                                        kind="int", bounds=(1, None))


def _check_model(config: Mapping[str, Mapping[str, Any]], local: LocalFolder) -> None:
    folder = local(config["drafter"]["model"])
    if folder is None:
        return
    from transformers import AutoConfig

    from drafter_node.early_exit import check_exit_layer

    check_exit_layer(AutoConfig.from_pretrained(str(folder)), config["drafter"]["assistant_early_exit"])


def _profile_model(drafter: Mapping[str, Any], path: str) -> tuple[Any, str]:
    from drafter_node.early_exit import exit_config

    layers = drafter["assistant_early_exit"]
    return exit_config(path, layers), f"first {layers} layers"


SPEC = DrafterSpec(
    name="early_exit",
    cls="drafter_node.early_exit:EarlyExitDrafter",
    title="early-exit self-speculative drafting",
    settings=EarlyExitSettings,
    model_defaults_to_target=True,
    check=lambda config: positive_int(config, "assistant_early_exit"),
    check_model=_check_model,
    profile_model=_profile_model,
    transformers="`assistant_early_exit=E`",
    drafts_with="the target's own first E layers (self-speculative)",
    holds="the target checkpoint's first E layers, final norm and LM head (only those weights are read); "
          "1 ≤ E ≤ layers − 1",
    # E layers of a model cost differently from the whole model: their profile is their own
    profile_variant=lambda settings, own: f"early_exit:{own.assistant_early_exit}",
    conformance="testkit.conformance:early_exit",
)
